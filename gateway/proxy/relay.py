"""Relaying an engine's answer to the client.

Successful answers are streamed chunk by chunk as they arrive: no SSE frame is parsed on
this path (LiteLLM's per-chunk re-serialisation costs ~1.5 ms); the tokens the engine
reports are read from the answer once it ends (proxy/usage.py; how each request is
metered: proxy/metering.py). Only the allowlisted
response headers cross (proxy/headers.py). Error answers are read whole under a cap and
scrubbed or replaced (proxy/scrub.py). A 204 or 304 is its head alone. (`/v1/models` is
answered by the gateway itself, from the pool's copy of the engines' lists:
routing/models.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from gateway.errors import EngineError, ModelNotFound
from gateway.exchange import Exchange
from gateway.proxy.disconnect import DisconnectWatch
from gateway.proxy.forward import gateway_error
from gateway.proxy.headers import RESPONSE_HEADERS
from gateway.proxy.metering import Metering
from gateway.proxy.scrub import about_model, excerpt, scrub_json
from gateway.proxy.usage import (
    EventUsage,
    Steps,
    Tail,
    Whole,
    audio_seconds,
    metadata_usage,
    parse_usage,
)
from gateway.responses import send_error, send_json, sse_error_frame
from gateway.types import Send
from gateway.upstream.errors import UpstreamError
from gateway.upstream.interfaces import NO_CONTENT, Response

log = structlog.get_logger("gateway.proxy.relay")

# Error answers are read whole up to this size, to be scrubbed or replaced; a larger
# one is replaced unread (vLLM's error bodies are a few hundred bytes).
_ERROR_LIMIT = 64 * 1024
# Responses up to this size with a Content-Length are read whole and sent in one
# message: one write instead of two for the common small JSON answer.
_SMALL_RESPONSE = 64 * 1024
_METADATA = b"metadata"
# Routes whose streams send one event per engine step, each with that step's tokens: a
# stream left early that reported no counts is metered one completion token an event
# relayed.
_TOKEN_EVENTS = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations"})


def response_headers(resp: Response) -> list[tuple[bytes, bytes]]:
    """The engine's response headers a client gets: only those in RESPONSE_HEADERS
    (`raw_headers` names are lower-case)."""
    return [(name, value) for name, value in resp.raw_headers if name in RESPONSE_HEADERS]


class Relay:
    """Sends one engine answer to its client. `idle` bounds the engine's silence between
    two chunks; time spent writing to a slow client is not counted against the engine.
    `grace`: how long a stream whose client left (or was dropped for not reading) is
    still read, unrelayed, for the counts the engine already sent; a JSON answer, made
    whole before it is sent, is read to its end within `idle`."""

    def __init__(self, idle: float, grace: float) -> None:
        self.idle = idle
        self.grace = grace

    def __call__(
        self,
        resp: Response,
        send: Send,
        ex: Exchange,
        watch: DisconnectWatch,
        meter: Metering,
    ) -> Awaitable[None]:
        """The coroutine that relays `resp`: the chosen method's own, not one around it
        (every wait of the answer resumes one frame less)."""
        if resp.status >= 400:
            return self.error(resp, send, ex, watch)
        if resp.status in NO_CONTENT:
            return self.head_only(resp, send, watch)
        return self.stream(resp, send, ex, watch, meter)

    async def head_only(self, resp: Response, send: Send, watch: DisconnectWatch) -> None:
        """A 204 or 304: the status and headers alone, as HTTP frames them (RFC 9112 6.3).
        Nothing is read from the engine, and its Content-Length is not relayed: a 204 may
        not have one, and uvicorn takes one for the length of a body still to come."""
        watch.stop()
        headers = [(n, v) for n, v in response_headers(resp) if n != b"content-length"]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def _read_capped(self, resp: Response, limit: int) -> bytes | None:
        """The whole body, or None when it is larger than `limit` (the rest is left
        unread: the connection is then closed, never reused)."""
        length = resp.content_length
        if length is not None and length > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.idle):
                while chunk := await resp.readany():
                    size += len(chunk)
                    if size > limit:
                        return None
                    chunks.append(chunk)
        except (UpstreamError, TimeoutError) as exc:
            raise gateway_error(exc, answering=True) from None
        return b"".join(chunks)

    async def error(self, resp: Response, send: Send, ex: Exchange, watch: DisconnectWatch) -> None:
        """An engine's 4xx or 5xx, small or streamed: a 4xx JSON body keeps its shape
        with every string scrubbed of URLs and addresses; anything else (every 5xx, a
        4xx that is not JSON or is over the cap) is replaced by `EngineError`, and the
        engine's text goes to the log. No engine header is relayed with either."""
        body = await self._read_capped(resp, _ERROR_LIMIT)
        watch.stop()
        status = resp.status
        if status == 404 and ex.model is not None and body is not None and about_model(body):
            # The engine does not serve the model the gateway sent it there for (its list
            # changed since last read, or a `served_models` name its resolver cannot load).
            model_error = ModelNotFound(ex.model)
            ex.code = model_error.code
            await send_error(send, model_error)
            return
        if status < 500 and body is not None:
            cleaned = scrub_json(body)
            if cleaned is not None:
                ex.bytes_out = len(cleaned)
                await send_json(send, status, cleaned)
                return
        log.warning(
            "engine_error",
            request_id=ex.request_id,
            engine=ex.engine,
            status=status,
            body=excerpt(body),
        )
        error = EngineError(status, ex.request_id)
        ex.code = error.code
        await send_error(send, error)

    async def stream(
        self,
        resp: Response,
        send: Send,
        ex: Exchange,
        watch: DisconnectWatch,
        meter: Metering,
    ) -> None:
        out_headers = response_headers(resp)
        if resp.content_type == "application/octet-stream" and meter.count:
            # A binary pooling answer: its usage is in the `metadata` header alone.
            for name, value in out_headers:
                if name == _METADATA:
                    ex.usage = metadata_usage(value)
            if meter.hide_metadata:
                out_headers = [(n, v) for n, v in out_headers if n != _METADATA]
        sse = resp.content_type == "text/event-stream"
        by_event = meter.events and sse
        # Audio is metered from the head on, whatever the format, streamed or cut short:
        # the engine has decoded the whole file before it answers.
        audio = meter.audio and 200 <= resp.status < 300
        length = resp.content_length
        if length is not None and length <= _SMALL_RESPONSE and not by_event:
            try:
                # One timer, no asyncio.timeout context: this is the common path.
                body = await resp.read(self.idle)
            except UpstreamError as exc:
                raise gateway_error(exc, answering=True) from None
            watch.stop()
            ex.bytes_out = len(body)
            if audio:
                ex.audio_seconds = meter.audio_seconds(None)
            await send(
                {"type": "http.response.start", "status": resp.status, "headers": out_headers}
            )
            # The start went through the gateway's send; the body goes straight to the
            # server.
            await (ex.send or send)({"type": "http.response.body", "body": body})
            # Once the client has its answer; held whole, so parsed whole.
            if meter.audio:
                if audio:
                    ex.audio_seconds = meter.audio_seconds(audio_seconds(body))
            elif meter.count and ex.usage is None:
                ex.usage = parse_usage(body)
            return

        await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
        if audio:
            ex.audio_seconds = meter.audio_seconds(None)
        if by_event:
            await self._events(resp, send, ex, watch, meter)
            return
        idle = self.idle
        # What the engine reports its usage in, read as it passes (gateway/proxy/usage.py).
        reader: Tail | Whole | None = None
        if meter.audio:
            # The seconds a JSON answer reports; a stream reports none.
            if audio and not sse:
                reader = Whole()
        elif meter.count and ex.usage is None:
            reader = Whole() if meter.whole else Tail()
        # A /v1/messages or /v1/responses stream: its events before its usage, for one
        # that ends without it.
        steps: Steps | None = None
        if isinstance(reader, Tail) and meter.steps and sse:
            steps = Steps()
        events = 0

        def take(chunk: bytes) -> None:
            nonlocal events
            if reader is not None:
                reader.add(chunk)
            if steps is not None:
                steps.add(chunk)
            events += chunk.count(b"\n\n")

        finished = False
        # A client that left: a JSON answer is generated whole before it is sent, its
        # usage at its end; a stream's unsent chunks carry the engine's latest counts.
        left_for = self.grace if sse else idle
        # The start went through the gateway's send; the chunks go straight to the server.
        send = ex.send or send
        watch.release()
        try:
            if ex.disconnected:
                # It left before the answer started (proxy/disconnect.py, `hold`).
                finished = await self._drain(resp, take, left_for)
            else:
                while True:
                    # The limit is the engine's silence: not counted while a slow client
                    # reads.
                    chunk = await resp.readsome(idle)
                    if not chunk:
                        break
                    ex.bytes_out += len(chunk)
                    take(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                finished = True
        except UpstreamError as exc:
            await self._broken(resp, send, ex, watch, exc)
            return
        except asyncio.CancelledError:
            if not ex.disconnected:
                raise
            finished = await self._drain(resp, take, left_for)
            raise
        finally:
            self._meter_stream(ex, meter, reader, steps, finished, events)
        watch.stop()
        await send({"type": "http.response.body", "body": b""})

    def _meter_stream(
        self,
        ex: Exchange,
        meter: Metering,
        reader: Tail | Whole | None,
        steps: Steps | None,
        finished: bool,
        events: int,
    ) -> None:
        """The usage of an answer read as it passed: read to its end (`finished`), or cut
        short (the client left, the engine broke)."""
        if isinstance(reader, Whole):
            # A JSON answer cut short has no usage to read.
            if finished:
                whole = reader.body()
                if whole is None:
                    log.warning("usage_unread", request_id=ex.request_id, engine=ex.engine)
                elif meter.audio:
                    ex.audio_seconds = meter.audio_seconds(audio_seconds(whole))
                else:
                    ex.usage = parse_usage(whole)
        elif reader is not None:
            # Cut short, a /v1/messages or /v1/responses stream is metered what its
            # events reported before its usage; any other answer the usage it passed.
            ex.usage = reader.usage() if steps is None else steps.usage(reader.usage())
        if not finished and meter.count:
            self._left_early(ex, events)

    async def _drain(self, resp: Response, take: Callable[[bytes], None], limit: float) -> bool:
        """Reads what the engine sends, unrelayed, into `take`, for at most `limit`
        seconds; whether the answer was read to its end."""
        try:
            async with asyncio.timeout(limit):
                while chunk := await resp.readsome(limit):
                    take(chunk)
        except (UpstreamError, TimeoutError):
            return False
        return True

    async def _events(
        self, resp: Response, send: Send, ex: Exchange, watch: DisconnectWatch, meter: Metering
    ) -> None:
        """A chat or completion stream, whose usage the gateway asked for in every chunk
        (proxy/metering.py)."""
        reader = EventUsage(
            hide_usage=meter.hide_usage,
            hide_chunk_usage=meter.hide_chunk_usage,
            choices=meter.choices,
            single=meter.single,
        )
        idle = self.idle

        def take(chunk: bytes) -> None:
            reader.feed(chunk)

        finished = False
        # The start went through the gateway's send; the chunks go straight to the server.
        send = ex.send or send
        watch.release()
        try:
            if ex.disconnected:
                # The client left before the stream started (proxy/disconnect.py, `hold`).
                finished = await self._drain(resp, take, self.grace)
            else:
                while True:
                    chunk = await resp.readsome(idle)
                    if not chunk:
                        break
                    out = reader.feed(chunk)
                    if out:
                        ex.bytes_out += len(out)
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                finished = True
        except UpstreamError as exc:
            await self._broken(resp, send, ex, watch, exc)
            return
        except asyncio.CancelledError:
            if not ex.disconnected:
                raise
            # The client left or was dropped for not reading: the chunks the engine
            # already sent carry its latest counts (vLLM merges the deltas it could not
            # send into its next chunk).
            await self._drain(resp, take, self.grace)
            raise
        finally:
            # Cut short (the client left, the engine broke): the engine's last counts.
            ex.usage = reader.usage()
            if not finished:
                self._left_early(ex, reader.events)
        watch.stop()
        rest = reader.flush()
        ex.bytes_out += len(rest)
        await send({"type": "http.response.body", "body": rest})

    def _left_early(self, ex: Exchange, events: int) -> None:
        """A stream cut before it reported any usage (the client left, the engine
        broke): metered one completion token an event relayed, on routes that send one
        event a step; the prompt's count is not known."""
        if ex.usage is None and ex.route.path in _TOKEN_EVENTS and events > 0:
            ex.usage = (0, events)

    async def _broken(
        self,
        resp: Response,
        send: Send,
        ex: Exchange,
        watch: DisconnectWatch,
        exc: UpstreamError,
    ) -> None:
        error = gateway_error(exc, answering=True)
        ex.code = error.code
        log.warning("upstream_broken", request_id=ex.request_id, engine=ex.engine)
        if resp.content_type == "text/event-stream":
            # Never a silent truncation: SSE clients get an error frame, as vLLM
            # sends one for its own mid-stream errors, then the stream ends.
            watch.stop()
            await send(
                {
                    "type": "http.response.body",
                    "body": sse_error_frame(error),
                    "more_body": False,
                }
            )
        # Other responses are left incomplete: the server then closes the client
        # connection, which a client sees as an error, not as a short body.
