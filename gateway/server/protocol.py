"""The HTTP/1.1 connection protocol the gateway runs under uvicorn: uvicorn's httptools
protocol with limits on the connection itself, which uvicorn does not have.

    uvicorn.run(app, http=GatewayProtocol, ...)      # gateway/cli.py, every worker

- Connection cap: at `limits.max_connections` open connections (this process), a new
  connection makes room by closing the one that has waited longest for a head (none
  sent yet, or incomplete; a connection with a request in progress is never closed for
  this), so clients that send their head at once displace those that do not. When every
  connection has a request in progress, the new one is closed as soon as it is
  accepted, before anything is read from it.
- Head deadline (slowloris): a request's head must be complete `timeouts.request_head`
  seconds after the connection opened or, on a keep-alive connection, after the
  previous response was sent; the clock does not restart with each byte. Past it the
  connection is closed without an answer: nothing is owed to a client that has not
  asked yet. A connection that sends nothing is closed the same way.
- Head size: a head over `limits.max_header_bytes` is answered 431 `headers_too_large`
  and the connection closed, after a short linger that reads and drops what the client
  still sends, so the answer is not lost to a reset. When a response to an earlier
  (pipelined) request is still being written, the connection is closed without one.
- Body chunks: a chunked body whose pieces average under `MIN_CHUNK_BYTES` once
  there are `MIN_CHUNKS` of them is answered 400 `body_chunks_too_small` and the
  connection closed after the same linger; the app sees the client gone (nothing is
  forwarded: the body is read whole first).
- Pipelining: at most `MAX_PIPELINED` requests wait behind the one being answered. A
  request beyond them ends the connection once those are answered (the last answer
  says `Connection: close`; what follows is dropped, the client retries it on a new
  connection, as RFC 9112 section 9.3.2 has pipelining clients do).
- Keep-alive idle: a keep-alive connection that sends nothing for
  `timeouts.client_keepalive` after a response is closed (not counted: HTTP allows it).
  This replaces uvicorn's keep-alive timer, one armed and cancelled per request.
- Response stall: a client that leaves its answer unread (the write buffer full, so the
  app waits to send) for `timeouts.response_stall` is dropped; the app sees a disconnect
  and the engine's request is aborted.

The request body's pace is the app's to enforce (gateway/proxy/body.py), where a 408 can be
answered in the gateway's error format. The deadlines are kept by the guard's sweep
(gateway/server/limits.py); per request this costs a few attribute writes, and no timer.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.config.settings import LimitsSettings, TimeoutSettings
from gateway.errors import BodyChunksTooSmall, HeadersTooLarge
from gateway.responses import raw_response
from gateway.server.limits import CONNECTION_GUARD, ConnectionGuard

_HEADERS_TOO_LARGE = raw_response(HeadersTooLarge())
_CHUNKS_TOO_SMALL = raw_response(BodyChunksTooSmall())
# The request line's fixed parts ("GET " and " HTTP/1.1\r\n") and the blank line, and
# each header line's ": " and "\r\n": a head's size as sent, whitespace aside.
_LINE_BYTES = 16
_FIELD_BYTES = 4
# Requests a connection may queue behind the one being answered. Unbounded in uvicorn,
# which parses every request in a read (up to 256 KiB) at once: 60 connections each
# writing 256 KiB of pipelined `GET /healthz` (no key) took the gateway from 60 MiB to
# 1,197 MiB (~2.2 KiB per queued request) and blocked its loop for 8 s.
MAX_PIPELINED = 16
# A chunked body's pieces as the parser hands them over (one per chunk, or per read of a
# larger chunk) must average MIN_CHUNK_BYTES once there are MIN_CHUNKS of them: each is a
# Python call into uvicorn, and 1-byte chunks (`1\r\n \r\n`) cost ~100 times the CPU per
# byte of a plain body: 4 connections sending them held the gateway's core and another
# key's median latency went from 5 ms to 0.39 s.
MIN_CHUNKS = 64
MIN_CHUNK_BYTES = 1024


class _HeadTooLarge(Exception):
    """Raised from the parser's callback to stop parsing a head over the cap."""


class _ChunksTooSmall(Exception):
    """Raised from the parser's callback to stop parsing a body in chunks too small."""


class _PipelineFull(Exception):
    """Raised from the parser's callback to stop parsing at a request that would
    queue beyond `MAX_PIPELINED`."""


def head_size(url: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """The size of a parsed request head, as sent but for optional whitespace."""
    return _LINE_BYTES + len(url) + sum(len(n) + len(v) + _FIELD_BYTES for n, v in headers)


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol held to the gateway's connection limits (module
    docstring). The limits come from the `ConnectionGuard` the app put in the lifespan
    state; without one (an app without the gateway's lifespan), the default limits."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        guard = app_state.get(CONNECTION_GUARD)
        if not isinstance(guard, ConnectionGuard):
            guard = app_state[CONNECTION_GUARD] = ConnectionGuard(
                TimeoutSettings(), LimitsSettings()
            )
        self.guard: ConnectionGuard = guard
        # Loop times (inf: none) by which the next head must be complete (none while a
        # request is handled), the next request must begin (after a response), and a
        # full write buffer must have drained.
        self._head_due = math.inf
        self._idle_due = math.inf
        self._write_due = math.inf
        self._refused = False
        # No byte arrived since the connection opened or the last response was sent.
        self._idle = True
        # Between a request's first byte and the end of its head.
        self._in_head = False
        # Bytes of the chunks that arrived whole within the current head; the length of
        # the chunk it began in (part of it may belong to the previous request).
        self._head_seen = 0
        self._head_first = 0
        self._chunk = 0
        self._head_refused = False
        # Parsing stopped at a request beyond MAX_PIPELINED: the queued ones are
        # answered, the rest of the input dropped.
        self._pipeline_full = False
        # The current body's pieces from the parser and their bytes; set off (None) once
        # a body with small pieces turned out not to be chunked.
        self._pieces: int | None = 0
        self._piece_bytes = 0
        self._chunks_refused = False
        # After a 431: input read and dropped until the client closes or the linger ends.
        self._lingering = False

    # --- the connection -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        guard = self.guard
        if len(self.connections) >= guard.max_connections and not guard.make_room():
            # Refused before anything is read or allocated for it; the descriptor goes
            # at once (abort: no lingering FIN handshake on our side).
            self._refused = True
            guard.counts.max_connections += 1
            transport.abort()
            return
        super().connection_made(transport)
        self._head_due = self.loop.time() + guard.request_head
        guard.add(self, self.loop)
        guard.waiting[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self.guard.discard(self)
        super().connection_lost(exc)

    @property
    def deadline(self) -> float:
        """The loop time at which the guard's sweep calls `expire`."""
        return min(self._head_due, self._idle_due, self._write_due)

    def expire(self) -> None:
        """Called by the guard's sweep once `deadline` has passed: the keep-alive wait
        is over, the head did not come in time, a 431's linger is over, or the client
        left its answer unread. Closed without an answer."""
        now = self.loop.time()
        stalled = self._write_due <= now
        late = self._head_due <= now and not self._lingering
        self._head_due = self._idle_due = self._write_due = math.inf
        transport = self.transport
        if transport.is_closing():
            return
        counts = self.guard.counts
        if stalled:
            counts.response_stall += 1
        elif late and self._idle:
            counts.idle_timeout += 1
        elif late:
            counts.head_timeout += 1
        # Else the keep-alive wait or a 431's linger ended: not counted.
        if transport.get_write_buffer_size():
            # The last response is still unread: a client that does not read is not
            # waited for.
            transport.abort()
        else:
            transport.close()

    def evict(self) -> None:
        """Called by the guard to make room for a new connection: this one is waiting
        for a head. Closed without an answer, as at the head deadline."""
        self._head_due = self._idle_due = math.inf
        if not self.transport.is_closing():
            self.transport.close()

    def handle_websocket_upgrade(self) -> None:
        # The connection now belongs to the WebSocket protocol (the app refuses it).
        self.guard.discard(self)
        super().handle_websocket_upgrade()

    # --- input ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received, with the head's byte count and the 431, and the
        # keep-alive wait a deadline instead of a timer.
        if self._lingering or self._pipeline_full:
            return
        if self._idle:
            self._idle = False
            self._idle_due = math.inf
        self._chunk = len(data)
        if self._in_head:
            self._head_seen += self._chunk
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._head_refused:
                self._refuse_head()
                return
            if self._pipeline_full:
                self._end_pipeline()
                return
            if self._chunks_refused:
                self._refuse_chunks()
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and self._head_seen > self.guard.max_header_bytes:
            # Every byte counted here belongs to the head still being parsed (httptools
            # holds a header value whole until it ends, at any size).
            self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_seen = 0
        self._head_first = self._chunk
        self._pieces = 0
        self._piece_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_due = math.inf
        cap = self.guard.max_header_bytes
        # An upper bound first (the chunks the head came in), the exact size only when
        # that bound is over the cap: chunks are large when a body follows the head.
        if self._head_seen + self._head_first > cap and head_size(self.url, self.headers) > cap:
            self._head_refused = True
            raise _HeadTooLarge
        if len(self.pipeline) >= MAX_PIPELINED:
            self._pipeline_full = True
            raise _PipelineFull
        # A request in progress: not to be evicted until its response is sent.
        self.guard.waiting.pop(self, None)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._pieces is not None:
            self._pieces += 1
            self._piece_bytes += len(body)
            if self._pieces >= MIN_CHUNKS and self._piece_bytes < self._pieces * MIN_CHUNK_BYTES:
                # Small reads of a Content-Length body are the client's pace, kept by
                # the body's minimum rate; only chunk framing multiplies the pieces.
                if any(
                    n == b"transfer-encoding" and b"chunked" in v.lower() for n, v in self.headers
                ):
                    self._chunks_refused = True
                    raise _ChunksTooSmall
                self._pieces = None
        super().on_body(body)

    def _refuse_chunks(self) -> None:
        self.guard.counts.body_chunks_too_small += 1
        cycle = self.cycle
        if cycle is not None:
            # The app, still reading the body, sees the client gone.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.abort()
                return
        self._answer_and_linger(_CHUNKS_TOO_SMALL)

    def _end_pipeline(self) -> None:
        """The last request queued is the connection's last: its answer closes it."""
        self.guard.counts.pipeline_full += 1
        self.pipeline[0][0].keep_alive = False

    def _refuse_head(self) -> None:
        self.guard.counts.headers_too_large += 1
        transport = self.transport
        if self.cycle is not None and not self.cycle.response_complete:
            # A response is being written: an answer now would land inside it.
            transport.abort()
            return
        self._answer_and_linger(_HEADERS_TOO_LARGE)

    def _answer_and_linger(self, answer: bytes) -> None:
        """Write `answer`, then read and drop input until the client closes or the
        linger ends, so the answer is not lost to a reset."""
        transport = self.transport
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._lingering = True
        self.flow.resume_reading()
        self._head_due = self.loop.time() + self.guard.linger

    # --- output ---------------------------------------------------------------------

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive wait a deadline instead of a timer.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        # The next head is due `request_head` after this response, not after the
        # client's next byte.
        now = self.loop.time()
        self._head_due = now + self.guard.request_head
        self.guard.waiting[self] = None
        if not self._in_head:
            self._idle = True
            self._idle_due = now + self.guard.keepalive

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_due = self.loop.time() + self.guard.response_stall

    def resume_writing(self) -> None:
        super().resume_writing()
        self._write_due = math.inf
