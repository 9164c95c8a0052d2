"""The HTTP/1.1 client the proxy forwards with: keep-alive connections to the engines.

General clients cost too much per request: httpx falls behind as concurrency rises
(encode/httpx#3215), and aiohttp's request machinery is a third of the gateway's CPU per
small request at 64 connections; with this client the gateway spends 140 us of CPU per
request, 268 with aiohttp (docs/facts.md, "Proxies and clients"; docs/gateway.md,
Overhead). It does only what forwarding needs: one request line and header block written
at once, the response parsed by httptools (llhttp, the parser uvicorn uses), the body
handed over as it arrives. The engine is addressed by configured URL only; nothing here
follows redirects, decompresses, or adds headers besides Host and Content-Length.

The same client serves the engine pool's health checks, model lists and load scrapes,
so one TLS configuration (`engine_ca_file`) covers everything sent to engines. Media
fetching keeps its own client (gateway/media/). The proxy and the pool depend only on
the `UpstreamClient` and `Response` protocols (interfaces.py), so tests can hand them a
fake engine. One connection and its answer: connection.py.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence

from gateway.upstream.connection import Connection, UpstreamResponse
from gateway.upstream.errors import (
    ClosedUnanswered,
    ConnectFailed,
    ConnectRefused,
    ConnectTimeout,
    NameUnresolved,
    ReconnectFailed,
    TlsFailed,
)
from gateway.upstream.origin import Origin


class Upstream:
    """Keep-alive connections to the engines, reused while idle for less than
    `keepalive` seconds (below vLLM's own 5 s, so a request is rarely written onto a
    connection the engine is closing). `aclose()` closes them all.

    A reused connection the engine closes before answering is its keep-alive timeout
    racing the request: uvicorn closes an idle connection without reading what arrived.
    The request is then sent once more, on a fresh connection to the same engine,
    whatever its method; if that connection is refused, ReconnectFailed.

    `ssl_context` checks engines' certificates (default: the system's trust store).
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        first_byte_timeout: float,
        keepalive: float,
        max_idle: int = 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        # The running loop, bound on first use: the client is built before the server
        # starts its loop (asyncio's lookup per request costs a getpid() on 3.11).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connect_timeout = connect_timeout
        self._first_byte = first_byte_timeout
        self._keepalive = keepalive
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int, bool, str | None], list[Connection]] = {}
        self._all: set[Connection] = set()
        self._ssl = ssl_context

    def forget(self, conn: Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin.key)
        if idle is not None and conn in idle:
            idle.remove(conn)

    def release(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.origin.key, [])
        if len(idle) >= self._max_idle:
            conn.abort()
            return
        assert self._loop is not None  # a connection exists, so a request bound it
        conn.idle_since = self._loop.time()
        conn.resume()
        idle.append(conn)

    def _reuse(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> Connection | None:
        """An idle connection to `origin` still open and young enough, or None."""
        idle = self._idle.get(origin.key)
        if idle:
            fresh = loop.time() - self._keepalive
            while idle:
                conn = idle.pop()  # most recently used first
                transport = conn.transport
                if (
                    conn.closed
                    or conn.idle_since < fresh
                    or transport is None
                    or transport.is_closing()
                ):
                    conn.abort()
                    continue
                return conn
        return None

    async def _open(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> Connection:
        """A new connection to `origin`; over TLS the certificate is checked against its
        server name. Raises ConnectFailed."""
        context: ssl.SSLContext | None = None
        server_name: str | None = None
        if origin.ssl:
            context = self._ssl = self._ssl or ssl.create_default_context()
            server_name = origin.server_name
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=server_name,
                )
        # TimeoutError, ssl.SSLError and socket.gaierror are OSErrors: the order matters.
        except TimeoutError:
            raise ConnectTimeout("connect") from None
        except ssl.SSLError:
            raise TlsFailed("connect") from None
        except socket.gaierror:
            raise NameUnresolved("connect") from None
        except ConnectionRefusedError:
            raise ConnectRefused("connect") from None
        except OSError:
            raise ConnectFailed("connect") from None
        self._all.add(protocol)
        return protocol

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> UpstreamResponse:
        """Send one request and wait for the response headers.

        `target` and `headers` must already be free of CR and LF (they come from
        uvicorn's parser and the endpoint table). Raises ConnectFailed when nothing
        reached the engine, ReconnectFailed, FirstByteTimeout, or ConnectionBroken.
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        conn = self._reuse(origin, loop)
        reused = conn is not None
        if conn is None:
            conn = await self._open(origin, loop)
        response = conn.send(loop, origin, method, target, headers, body)
        try:
            await response.start(self._first_byte)
        except ClosedUnanswered:
            response.close()
            if not reused:
                raise
            # Closed under the request without a byte of answer: once more, fresh.
            try:
                conn = await self._open(origin, loop)
            except ConnectFailed:
                raise ReconnectFailed("reconnect") from None
            response = conn.send(loop, origin, method, target, headers, body)
            try:
                await response.start(self._first_byte)
            except BaseException:
                response.close()
                raise
        except BaseException:
            response.close()
            raise
        return response

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
        self._idle.clear()
