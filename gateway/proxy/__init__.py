"""One forwarded request, in the order it happens: the handler, the body, uploads, the
forward with failover, the relay of the answer, and the helpers each step needs."""
