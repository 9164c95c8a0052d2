"""The client-side HTTP/1.1 server: uvicorn's protocol with the gateway's limits, the
connection and body limits, and the process's own tuning (allocator, fd limit)."""
