"""The engine-side HTTP/1.1 client: errors, origins, the client interface, one connection,
and the pooled client."""
