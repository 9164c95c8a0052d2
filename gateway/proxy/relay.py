"""Relaying an engine's answer to the client.

Successful answers are streamed chunk by chunk as they arrive: no SSE frame is parsed on
this path (LiteLLM's per-chunk re-serialisation costs ~1.5 ms); the tokens the engine
reports are read from the answer once it ends (proxy/usage.py). Only the allowlisted
response headers cross (proxy/headers.py). Error answers are read whole under a cap and
scrubbed or replaced (proxy/scrub.py). A 204 or 304 is its head alone. (`/v1/models` is
answered by the gateway itself, from the pool's copy of the engines' lists:
routing/models.py.)
"""

from __future__ import annotations

import asyncio

import structlog

from gateway.errors import EngineError, ModelNotFound
from gateway.exchange import Exchange
from gateway.proxy.disconnect import DisconnectWatch
from gateway.proxy.forward import gateway_error
from gateway.proxy.headers import RESPONSE_HEADERS
from gateway.proxy.scrub import about_model, excerpt, scrub_json
from gateway.proxy.usage import Tail, read_usage
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


def response_headers(resp: Response) -> list[tuple[bytes, bytes]]:
    """The engine's response headers a client gets: only those in RESPONSE_HEADERS
    (`raw_headers` names are lower-case)."""
    return [(name, value) for name, value in resp.raw_headers if name in RESPONSE_HEADERS]


class Relay:
    """Sends one engine answer to its client. `idle` bounds the engine's silence between
    two chunks; time spent writing to a slow client is not counted against the engine."""

    def __init__(self, idle: float) -> None:
        self.idle = idle

    async def __call__(
        self, resp: Response, send: Send, ex: Exchange, watch: DisconnectWatch
    ) -> None:
        if resp.status >= 400:
            await self.error(resp, send, ex, watch)
        elif resp.status in NO_CONTENT:
            await self.head_only(resp, send, watch)
        else:
            await self.stream(resp, send, ex, watch)

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
        self, resp: Response, send: Send, ex: Exchange, watch: DisconnectWatch
    ) -> None:
        out_headers = response_headers(resp)
        length = resp.content_length
        if length is not None and length <= _SMALL_RESPONSE:
            try:
                # One timer, no asyncio.timeout context: this is the common path.
                body = await resp.read(self.idle)
            except UpstreamError as exc:
                raise gateway_error(exc, answering=True) from None
            watch.stop()
            ex.bytes_out = len(body)
            await send(
                {"type": "http.response.start", "status": resp.status, "headers": out_headers}
            )
            await send({"type": "http.response.body", "body": body})
            # Once the client has its answer.
            ex.usage = read_usage(body)
            return

        await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
        idle = self.idle
        # What the engine reports its usage in, searched as it passes (gateway/proxy/usage.py).
        tail = Tail()
        try:
            while True:
                # The limit is the engine's silence: not counted while a slow client reads.
                chunk = await resp.readsome(idle)
                if not chunk:
                    break
                ex.bytes_out += len(chunk)
                tail.add(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
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
            return
        watch.stop()
        ex.usage = tail.usage()
        await send({"type": "http.response.body", "body": b""})
