"""What forwarding to an engine raises: one tree under `UpstreamError`, each message fixed
text, never a library's. `gateway_error` (gateway/proxy/forward.py) maps them to the
client's errors; the pool's health reasons (gateway/routing/health.py) tell the
`ConnectFailed` kinds apart.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """Forwarding to an engine failed. The message is fixed text, never a library's."""


class ConnectFailed(UpstreamError):
    """No connection could be opened: nothing reached the engine. The subclasses say
    why, for the pool's health reasons (gateway/routing/health.py)."""


class ConnectRefused(ConnectFailed):
    """The engine's address refused the connection: nothing listens on that port."""


class ConnectTimeout(ConnectFailed):
    """No connection within `timeouts.connect`."""


class TlsFailed(ConnectFailed):
    """The TLS handshake failed, or the engine's certificate was not trusted."""


class NameUnresolved(ConnectFailed):
    """The engine's host name has no address."""


class FirstByteTimeout(UpstreamError):
    """The engine did not start answering within the first-byte timeout."""


class ReadTimeout(UpstreamError):
    """A response body did not arrive in time."""


class ConnectionBroken(UpstreamError):
    """The connection failed or carried something that is not an HTTP response."""


class ClosedUnanswered(ConnectionBroken):
    """The engine closed the connection before sending any byte of an answer."""


class ReconnectFailed(UpstreamError):
    """The engine closed a reused connection without answering, then refused a fresh
    one: it is going away, and may or may not have read the request."""
