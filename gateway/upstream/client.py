"""The HTTP/1.1 client the proxy forwards with: keep-alive connections to the engines.

httpx lost 3-7x of aiohttp's throughput as concurrency rose (docs/facts.md, encode/httpx#3215),
and aiohttp's request machinery (ClientSession._request, ClientRequest, a writer task per
request with a body) was a third of the gateway's CPU per small request at 64
connections (py-spy); replacing it took the gateway from 268 to 140 us of CPU per request
(docs/gateway.md, Overhead). This client does
only what forwarding needs: one request line and header block written at once, the
response parsed by httptools (llhttp, the parser uvicorn uses), the body handed over as
it arrives. The engine is addressed by configured URL only; nothing here follows
redirects, decompresses, or adds headers besides Host and Content-Length.

The same client serves the engine pool's health checks, model lists and load scrapes,
so one TLS configuration (`engine_ca_file`) covers everything sent to engines. Media
fetching keeps its own client (gateway/media/). The proxy and the pool depend only on
the `UpstreamClient` and `Response` protocols below, so tests can hand them a fake engine.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Final, Protocol, cast
from urllib.parse import urlsplit

import httptools

# A response body buffered beyond this pauses reading from the engine until the
# client side catches up (back-pressure instead of unbounded memory).
_HIGH_WATER = 256 * 1024
# Request bodies up to this size go out in the same write as the head (one system call);
# larger ones in a second write, so an upload is never copied whole.
_COPY_LIMIT = 64 * 1024
# Final statuses whose answer ends with its head, whatever its fields say (RFC 9112 6.3;
# httptools reads them so): no body is read for them, and none is relayed (proxy/relay.py).
NO_CONTENT: Final = frozenset({204, 304})


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


class Response(Protocol):
    """An engine's answer as the relay reads it (`UpstreamResponse`, or a test's fake)."""

    status: int
    # Names lower-cased, values as sent.
    raw_headers: list[tuple[bytes, bytes]]
    content_length: int | None
    content_type: str

    async def read(self, limit: float) -> bytes:
        """The whole body within `limit` seconds; raises ReadTimeout or ConnectionBroken."""
        ...

    async def readany(self) -> bytes:
        """The next bytes of the body, b"" at its end; raises ConnectionBroken."""
        ...

    async def readsome(self, limit: float) -> bytes:
        """`readany`, waiting at most `limit` seconds for the next bytes; raises
        ReadTimeout or ConnectionBroken."""
        ...

    def close(self) -> None:
        """Release the answer: its connection is reused only if it was read to the end."""
        ...


class UpstreamClient(Protocol):
    """What the proxy sends requests with (`Upstream`, or a test's fake engine)."""

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> Response:
        """Send one request and return once the response headers arrived. Raises
        ConnectFailed when nothing reached the engine, ReconnectFailed,
        FirstByteTimeout, or ConnectionBroken."""
        ...

    async def aclose(self) -> None: ...


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


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, pool: Upstream, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        # Whether any byte arrived since the current request was written.
        self.answered = False
        self._paused = False
        self._extra = False
        self._interim = False

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.answered = True
        response = self.response
        if response is None or response.complete:
            # Bytes nobody asked for: the connection is not reusable.
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        # A 101 with an Upgrade header ends the parse with HttpParserUpgrade, which is
        # not an HttpParserError: escaping here, uvloop logged a fatal transport error.
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            response._fail(ConnectionBroken("The engine sent an invalid HTTP response."))
            self.abort()
            return
        if self._extra:
            # A second response in the same read: never handed to anyone.
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        response = self.response
        if response is not None and not response.complete:
            if response.headers_done and response.until_eof:
                response._finish()
            elif not self.answered:
                response._fail(ClosedUnanswered("The engine closed the connection."))
            else:
                response._fail(ConnectionBroken("The engine closed the connection."))

    # -- httptools callbacks (the response's events; none after it is complete) --------

    def on_message_begin(self) -> None:
        assert self.response is not None
        if self.response.complete:
            self._extra = True
        # An interim answer (1xx) was read: the final one follows on its own message.
        self._interim = False

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        assert response is not None
        # After the head, fields are a chunked body's trailer: never response headers.
        if not self._extra and not response.headers_done:
            response.raw_headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        if self._extra:
            return
        status = self.parser.get_status_code()
        if status < 200:
            # 100 Continue, 103 Early Hints: interim heads with no body, and nothing the
            # client asked for (the gateway forwards no Expect); the final answer follows.
            # Not 101: httptools stops at it (the rest of the connection is another
            # protocol, which the gateway never asks for), an invalid answer.
            self._interim = True
            response.raw_headers.clear()
            return
        if status > 599:
            # No HTTP status, and none a server can relay (uvicorn has no status line
            # for it): raised here, it fails the response as an invalid one.
            raise ValueError("status out of range")
        response._headers_complete(status)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        if self._interim:
            # No 1xx has content (RFC 9112 6.3), but httptools reads a Content-Length or
            # chunks after a status it does not know (150) as the interim head's body:
            # the two readings of the bytes differ, so the answer is invalid (fed to the
            # final answer, they made its body longer than its Content-Length).
            raise ValueError("content in an interim answer")
        if not self._extra:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        if not self._extra and not self._interim:
            response.keep_alive = self.parser.should_keep_alive() and not response.misframed
            response._finish()

    # -- flow control -----------------------------------------------------------------

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """An engine's answer. The caller must `close()` it: a response read to its end
    returns its connection to the pool, anything else closes the connection (vLLM
    then aborts the request and frees its KV blocks)."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_error",
        "_loop",
        "_size",
        "_waiter",
        "complete",
        "content_length",
        "content_type",
        "headers_done",
        "keep_alive",
        "misframed",
        "raw_headers",
        "status",
        "until_eof",
    )

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._loop = loop
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.content_type = ""
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        # A 204 or 304 that announced a body: it ends with its head all the same.
        self.misframed = False
        self.until_eof = False
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection --------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _headers_complete(self, status: int) -> None:
        self.status = status
        chunked = False
        for name, value in self.raw_headers:
            if name == b"content-length":
                self.content_length = int(value) if value.isdigit() else None
            elif name == b"content-type":
                self.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if status in NO_CONTENT:
            # Bytes of the body it announced may follow the head: they would be read as
            # the next request's answer, so the connection is closed, never reused.
            self.misframed = chunked or bool(self.content_length)
            self.content_length = 0
            chunked = False
        self.until_eof = self.content_length is None and not chunked
        self.headers_done = True
        self._wake()

    def _feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self._size += len(body)
        if self._size > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None and not self.complete:
            self._error = error
            self._wake()

    def _time_out(self, error: type[UpstreamError]) -> None:
        self._fail(error("timeout"))

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- for the caller ---------------------------------------------------------------

    async def _start(self, limit: float) -> None:
        """Wait for the status line and headers (at most `limit` seconds). A plain timer,
        not `asyncio.timeout`: no context object and cancellation on the common path."""
        handle = self._loop.call_later(limit, self._time_out, FirstByteTimeout)
        try:
            while not self.headers_done:
                if self._error is not None:
                    raise self._error
                await self._wait()
        finally:
            handle.cancel()

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; b"" at
        the end. Raises ConnectionBroken when the connection fails mid-body."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        self._conn.resume()
        return chunk

    async def readsome(self, limit: float) -> bytes:
        """`readany`, waiting at most `limit` seconds for bytes (ReadTimeout): what is
        bounded is the engine's silence, not the caller's time between calls. A plain
        timer, and only when there is nothing to return yet: `asyncio.timeout`'s
        reschedule per chunk cost a TimerHandle and a getpid() system call (strace)."""
        if self._chunks or self.complete or self._error is not None:
            return await self.readany()
        handle = self._loop.call_later(limit, self._time_out, ReadTimeout)
        try:
            return await self.readany()
        finally:
            handle.cancel()

    async def read(self, limit: float) -> bytes:
        """The whole body (for bodies known to be small), within `limit` seconds."""
        if not self.complete:
            # Small answers usually arrive with their headers: no timer for those.
            handle = self._loop.call_later(limit, self._time_out, ReadTimeout)
            try:
                while not self.complete:
                    if self._error is not None:
                        raise self._error
                    # The whole body is wanted: reading goes on past the high-water mark.
                    self._conn.resume()
                    await self._wait()
            finally:
                handle.cancel()
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    def close(self) -> None:
        conn = self._conn
        if conn.response is not self:
            return
        conn.response = None
        if self.complete and self.keep_alive and not conn.closed:
            conn.pool._release(conn)
        else:
            conn.abort()


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
        self._idle: dict[tuple[str, int, bool, str | None], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._ssl = ssl_context

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin.key)
        if idle is not None and conn in idle:
            idle.remove(conn)

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin.key, [])
        if len(idle) >= self._max_idle:
            conn.abort()
            return
        assert self._loop is not None  # a connection exists, so a request bound it
        conn.idle_since = self._loop.time()
        conn.resume()
        idle.append(conn)

    def _reuse(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> _Connection | None:
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

    async def _open(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> _Connection:
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
                    lambda: _Connection(self, origin),
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
        response = self._send(conn, loop, origin, method, target, headers, body)
        try:
            await response._start(self._first_byte)
        except ClosedUnanswered:
            response.close()
            if not reused:
                raise
            # Closed under the request without a byte of answer: once more, fresh.
            try:
                conn = await self._open(origin, loop)
            except ConnectFailed:
                raise ReconnectFailed("reconnect") from None
            response = self._send(conn, loop, origin, method, target, headers, body)
            try:
                await response._start(self._first_byte)
            except BaseException:
                response.close()
                raise
        except BaseException:
            response.close()
            raise
        return response

    @staticmethod
    def _send(
        conn: _Connection,
        loop: asyncio.AbstractEventLoop,
        origin: Origin,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> UpstreamResponse:
        """Write one request on `conn`; its response is fed by the connection."""
        response = UpstreamResponse(conn, loop)
        conn.response = response
        conn.answered = False
        head = [
            f"{method} {origin.base_path}{target} HTTP/1.1\r\n".encode("latin-1"),
            b"Host: ",
            origin.host_header,
            b"\r\n",
        ]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        if body is not None or method == "POST":
            head += (b"Content-Length: ", str(len(body or b"")).encode("ascii"), b"\r\n")
        head.append(b"\r\n")
        transport = conn.transport
        assert transport is not None
        if body and len(body) > _COPY_LIMIT:
            # A large body is not copied into one buffer with the head.
            transport.write(b"".join(head))
            transport.write(body)
        else:
            if body:
                head.append(body)
            transport.write(b"".join(head))
        return response

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._all.clear()
        self._idle.clear()
