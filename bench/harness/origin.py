"""An HTTP server on loopback for media origins and canaries, in the bench's own process.

Used by the benchmarks (an image origin, the SSRF canary) and by the tests. With no
routes it is a canary: it answers 418 and `contacted` proves whether anything reached it.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.harness.background import InThread
from bench.harness.server import free_port


@dataclass
class Hit:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


class QuietHandler(BaseHTTPRequestHandler):
    """A keep-alive request handler that logs nothing (the servers record what they need)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass


class ThreadedServer(InThread):
    """An HTTP server on loopback (a free port), served by a daemon thread while the
    `with` block runs; over TLS when given a server context."""

    def __init__(
        self,
        handler: type[BaseHTTPRequestHandler],
        host: str = "127.0.0.1",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._server = ThreadingHTTPServer((host, free_port()), handler)
        self._server.daemon_threads = True
        self.tls = tls
        if tls is not None:
            # The handshake runs as a connection is accepted: one that fails never
            # reaches the handler (for RecordingServer: in neither `connections` nor `hits`).
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.port = int(self._server.server_address[1])
        super().__init__()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def run(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RecordingServer(ThreadedServer):
    """A threaded HTTP server on loopback that records every request it gets.

    As a canary (no routes) it answers 418 and `hits` proves whether anything reached it.
    As a media origin it serves the `routes` given, by path.
    """

    def __init__(
        self,
        routes: Mapping[str, Route] | None = None,
        host: str = "127.0.0.1",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.routes: dict[str, Route] = dict(routes or {})
        self.hits: list[Hit] = []
        self.connections = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(QuietHandler):
            def setup(self) -> None:
                with outer._lock:
                    outer.connections += 1
                super().setup()

            def _serve(self) -> None:
                with outer._lock:
                    outer.hits.append(Hit(self.command, self.path, dict(self.headers.items())))
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                route = outer.routes.get(self.path.split("?")[0])
                if route is None:
                    route = Route(status=418, body=b"canary")
                if route.delay:
                    time.sleep(route.delay)
                self.send_response(route.status)
                for k, v in route.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(route.body)

            do_GET = do_POST = do_HEAD = do_PUT = _serve

        super().__init__(Handler, host, tls)

    @property
    def contacted(self) -> bool:
        return self.connections > 0 or bool(self.hits)
