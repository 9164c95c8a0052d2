"""One keep-alive HTTP/1.1 connection to an engine, and the answer it carries.

The response is parsed by httptools (llhttp, the parser uvicorn uses) and its body handed
over as it arrives, with back-pressure: a body buffered beyond `_HIGH_WATER` pauses reading
from the engine until the caller catches up. The pool that owns a connection
(`ConnectionPool`: client.py's `Upstream`) takes it back when its answer was read whole.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Sequence
from typing import Protocol, cast

import httptools

from gateway.upstream.errors import (
    ClosedUnanswered,
    ConnectionBroken,
    FirstByteTimeout,
    ReadTimeout,
    UpstreamError,
)
from gateway.upstream.interfaces import NO_CONTENT
from gateway.upstream.origin import Origin

# A response body buffered beyond this pauses reading from the engine until the
# client side catches up (back-pressure instead of unbounded memory).
_HIGH_WATER = 256 * 1024
# Request bodies up to this size go out in the same write as the head (one system call);
# larger ones in a second write, so an upload is never copied whole.
_COPY_LIMIT = 64 * 1024


@functools.lru_cache(maxsize=64)
def media_type(content_type: bytes) -> str:
    """The media type of a Content-Type value, lower case, without its parameters.
    Remembered: an engine answers with a few values, and the four method calls cost
    ~3K instructions an answer (callgrind)."""
    return content_type.split(b";", 1)[0].strip().lower().decode("latin-1")


class ConnectionPool(Protocol):
    """What a connection reports to the pool that opened it."""

    def release(self, conn: Connection) -> None:
        """`conn` finished an answer read to its end: it may carry the next request."""
        ...

    def forget(self, conn: Connection) -> None:
        """`conn` closed: it carries nothing more."""
        ...


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, pool: ConnectionPool, origin: Origin) -> None:
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
        # not an HttpParserError: escaping here, it makes uvloop log a fatal transport
        # error.
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            response._fail(ConnectionBroken("The engine sent an invalid HTTP response."))
            self.abort()
            return
        if self._extra:
            # A second response in the same read: never handed to anyone.
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
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
        response = self.response
        assert response is not None
        if self._interim:
            # No 1xx has content (RFC 9112 6.3), but httptools reads a Content-Length or
            # chunks after a status it does not know (150) as the interim head's body:
            # the two readings of the bytes differ, so the answer is invalid (fed to the
            # final answer, they would make its body longer than its Content-Length).
            raise ValueError("content in an interim answer")
        if self._extra:
            return
        # Fed here, `_wake` inlined: once per body piece (each event of a stream), where
        # a Python call costs ~0.5-1K instructions (callgrind).
        response._chunks.append(body)
        response._size += len(body)
        if response._size > _HIGH_WATER:
            self.pause()
        waiter = response._waiter
        if waiter is not None:
            response._waiter = None
            if not waiter.done():
                waiter.set_result(None)

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

    def send(
        self,
        loop: asyncio.AbstractEventLoop,
        origin: Origin,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> UpstreamResponse:
        """Write one request; its response is fed by this connection. `origin` is the
        request's (its base path and Host): a connection is shared by origins with the
        same `key`, which may differ in those. `target` and `headers` must already be
        free of CR and LF."""
        response = UpstreamResponse(self, loop)
        self.response = response
        self.answered = False
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
        transport = self.transport
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

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
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
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _headers_complete(self, status: int) -> None:
        self.status = status
        chunked = False
        for name, value in self.raw_headers:
            if name == b"content-length":
                self.content_length = int(value) if value.isdigit() else None
            elif name == b"content-type":
                self.content_type = media_type(value)
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

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None and not self.complete:
            self._error = error
            self._wake()

    def _time_out(self, error: type[UpstreamError]) -> None:
        self._fail(error("timeout"))

    def _wait(self) -> asyncio.Future[None]:
        """The future the connection's next event sets, to be awaited: a plain future,
        not a coroutine around it (one frame less per wait). `_wake` forgets it; one
        cancelled with its waiter is done, and never set."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiter = waiter
        return waiter

    # -- for the caller ---------------------------------------------------------------

    async def start(self, limit: float) -> None:
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

    def _take(self) -> bytes:
        """What `readany` returns once there is something to return: the bytes that
        arrived, else b"" at the end, else the error."""
        chunks = self._chunks
        if chunks:
            chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._size = 0
            self._conn.resume()
            return chunk
        if self.complete:
            return b""
        assert self._error is not None
        raise self._error

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; b"" at
        the end. Raises ConnectionBroken when the connection fails mid-body."""
        while not (self._chunks or self.complete or self._error is not None):
            await self._wait()
        return self._take()

    async def readsome(self, limit: float) -> bytes:
        """`readany`, waiting at most `limit` seconds for bytes (ReadTimeout): what is
        bounded is the engine's silence, not the caller's time between calls. A plain
        timer, and only when there is nothing to return yet: `asyncio.timeout`'s
        reschedule per chunk cost a TimerHandle and a getpid() system call (strace)."""
        if not (self._chunks or self.complete or self._error is not None):
            handle = self._loop.call_later(limit, self._time_out, ReadTimeout)
            try:
                while not (self._chunks or self.complete or self._error is not None):
                    await self._wait()
            finally:
                handle.cancel()
        return self._take()

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
            conn.pool.release(conn)
        else:
            conn.abort()
