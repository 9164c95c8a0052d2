"""Where an engine is: its scheme, host, port, base path and the name it is addressed by."""

from __future__ import annotations

from urllib.parse import urlsplit


class Origin:
    """An engine's scheme, host, port and base path, parsed once from its configured URL
    (an engine served under a path prefix gets every request under that prefix).

    `server_name` is the name of an engine its URL names by address (one resolved from
    a `dns+https://name` entry): the connection goes to the URL's address, while the
    Host header and, over TLS, the server name sent (SNI) and checked against the
    certificate are `server_name`. None: the URL's host is the name.
    """

    __slots__ = ("base_path", "host", "host_header", "key", "port", "server_name", "ssl")

    def __init__(self, url: str, server_name: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an engine URL must be http:// or https:// with a host")
        if not parts.netloc.isascii() or not (server_name or "").isascii():
            # It goes out as the Host header and the TLS server name: an IDN in its
            # ASCII (xn--) form.
            raise ValueError("an engine's host name must be ASCII (an IDN in its xn-- form)")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.server_name = server_name
        if server_name is None:
            self.host_header = parts.netloc.rsplit("@", 1)[-1].encode("ascii")
        elif self.port == (443 if self.ssl else 80):
            self.host_header = server_name.encode("ascii")
        else:
            self.host_header = f"{server_name}:{self.port}".encode("ascii")
        self.base_path = parts.path.rstrip("/")
        # Idle connections are shared by origins with the same key only: one opened
        # under another server name was checked against another certificate name.
        self.key = (self.host, self.port, self.ssl, server_name)
