"""The streaming forwarder: body checks, engine choice, relaying the engine's answer.

Requests go out through `gateway.upstream` (why not aiohttp or httpx: see there). Bodies
are forwarded as received and successful responses streamed chunk by chunk as they
arrive: no SSE frame is parsed on this path (LiteLLM's per-chunk re-serialisation costs
~1.5 ms). Headers cross in both directions by allowlist (headers.py); engine error
answers are read whole under a cap and scrubbed or replaced (engine_errors.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import orjson
import structlog

from gateway.body import ClientDisconnected, check_declared, read_body
from gateway.config import Settings
from gateway.endpoints import BodyKind, Group
from gateway.engine_errors import excerpt, scrub_json
from gateway.errors import (
    EngineError,
    FieldNotAllowed,
    InvalidJson,
    ModelNotAllowed,
    NoEngineAvailable,
    UnsupportedMediaType,
    UpstreamBroken,
    UpstreamInvalid,
    UpstreamTimeout,
    UpstreamUnavailable,
    send_error,
    sse_error_frame,
)
from gateway.exchange import SCOPE_KEY, Exchange, Receive, Scope, Send
from gateway.headers import RESPONSE_HEADERS, request_allowlist
from gateway.metrics import Metrics
from gateway.multipart import validate_upload
from gateway.payload import PayloadInspector
from gateway.routing.policy import Policy, RoutingRequest
from gateway.routing.pool import Engine, EnginePool
from gateway.upstream import (
    ConnectFailed,
    FirstByteTimeout,
    Origin,
    Upstream,
    UpstreamError,
    UpstreamResponse,
)

log = structlog.get_logger("gateway.proxy")

# The Content-Type a JSON request is forwarded with: the media type that was checked,
# never the client's header (a `Connection: content-type` once stripped that header
# after it was validated).
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")
# vLLM's SageMaker wrapper: its body `model` is replaced before vLLM reads it.
_INVOCATIONS = "/invocations"
# Error answers are read whole up to this size, to be scrubbed or replaced; a larger
# one is replaced unread (vLLM's error bodies are a few hundred bytes).
_ERROR_LIMIT = 64 * 1024
# Responses up to this size with a Content-Length are read whole and sent in one
# message: one write instead of two for the common small JSON answer.
_SMALL_RESPONSE = 64 * 1024
# A model list read whole to be filtered for a key limited to some models.
_MODEL_LIST_LIMIT = 1024 * 1024
# How long a request is forwarded before a task starts watching for its client leaving.
# A task per request (created, stepped, cancelled) cost ~70 us of event-loop work at 64
# connections (py-spy); the timer that replaces it for quick answers costs ~1 us. A client
# that leaves is noticed at most this much later.
WATCH_AFTER = 0.05


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"


def _response_headers(resp: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    """The engine's response headers a client gets: only those in RESPONSE_HEADERS."""
    return [(name, value) for name, value in resp.raw_headers if name.lower() in RESPONSE_HEADERS]


class DisconnectWatch:
    """Cancels `task` when its client disconnects, so the upstream connection closes and
    vLLM aborts the request and frees its KV blocks.

    The watching task is started only once the request has been forwarded for
    `WATCH_AFTER` seconds: most answers are complete sooner and then cost one timer, not
    a task. The caller must `stop()` the watch before sending the answer's last message
    (after it uvicorn's `receive` reports a disconnect) and when it is done.
    """

    __slots__ = ("_ex", "_handle", "_loop", "_receive", "_target", "_task")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        receive: Receive,
        ex: Exchange,
        target: asyncio.Task[Any],
    ) -> None:
        self._loop = loop
        self._receive = receive
        self._ex = ex
        self._target = target
        self._task: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = loop.call_later(WATCH_AFTER, self._start)

    def _start(self) -> None:
        self._handle = None
        self._task = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._ex.disconnected = True
                self._target.cancel()
                return

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._task is not None:
            self._task.cancel()
            self._task = None


class Proxy:
    """The innermost ASGI app: forwards an authorised request to an engine."""

    def __init__(
        self,
        settings: Settings,
        pool: EnginePool,
        policy: Policy,
        metrics: Metrics,
        inspector: PayloadInspector,
    ) -> None:
        self.settings = settings
        self.inspector = inspector
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        # Set by the app's lifespan (`start`), which also closes the upstream client.
        self.upstream: Upstream | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        upstream_key = settings.upstream_api_key
        self._auth_header: list[tuple[bytes, bytes]] = (
            [(b"authorization", f"Bearer {upstream_key.get_secret_value()}".encode())]
            if upstream_key is not None
            else []
        )
        self._forwarded = request_allowlist(settings.forward_headers)
        self._idle = settings.timeouts.idle
        self._origins: dict[str, Origin] = {}
        header = settings.routing.session_header
        # ASGI header names are lowercase bytes.
        self._session_header = header.strip().lower().encode("latin-1") if header else None
        self._counts = metrics.routing

    def start(self) -> Upstream:
        """Create the upstream client on the running loop; the caller closes it. The
        loop is kept: asyncio's loop lookup costs a getpid() call on Python 3.11."""
        t = self.settings.timeouts
        self.loop = asyncio.get_running_loop()
        self.upstream = Upstream(
            self.loop,
            connect_timeout=t.connect,
            # Bounds the wait for the response headers; the silence between body chunks
            # is bounded separately by `timeouts.idle`.
            first_byte_timeout=t.first_byte,
            keepalive=t.upstream_keepalive,
        )
        return self.upstream

    def _origin(self, engine: Engine) -> Origin:
        origin = self._origins.get(engine.url)
        if origin is None:
            if len(self._origins) > 2 * len(self.pool.engines) + 16:
                # Engines named by DNS come and go: forget the origins of departed ones.
                self._origins.clear()
            try:
                origin = self._origins[engine.url] = Origin(engine.url)
            except ValueError:
                # Not a usable engine URL: nothing can reach it, like a refused connect.
                raise ConnectFailed("engine URL") from None
        return origin

    def _upstream_headers(
        self, scope: Scope, request_id: str, content_type: tuple[bytes, bytes] | None
    ) -> list[tuple[bytes, bytes]]:
        """The headers an engine gets: the checked Content-Type, the client's headers on
        the allowlist (headers.py), our request id and the engine key. The client's
        Authorization, Connection and every header vLLM acts on stay behind."""
        headers: list[tuple[bytes, bytes]] = [] if content_type is None else [content_type]
        forward = self._forwarded
        for name, value in scope["headers"]:
            if name in forward:
                headers.append((name, value))
        headers.append((b"x-request-id", request_id.encode("ascii")))
        headers.extend(self._auth_header)
        return headers

    def _check_invocation(self, ex: Exchange, body: dict[str, Any]) -> None:
        """`/invocations`: vLLM 0.32 serves it under `model_hosting_container_standards`
        (0.1.16), whose `inject_adapter_id(adapter_path="model")` sets the body's `model`
        to the `X-Amzn-SageMaker-Adapter-Identifier` header, or to null when the header
        is absent, before vLLM reads the body. The gateway never forwards that header
        (headers.py), so vLLM always runs its default model there, whatever the body
        names: a key limited to some models cannot be held to them and is refused.
        Stateful-session requests (`requestType`) are the wrapper's, not inference."""
        if "requestType" in body:
            raise FieldNotAllowed(
                "SageMaker session requests are not served through this gateway.",
                param="requestType",
            )
        key = ex.key
        if key is not None and key.models is not None:
            raise ModelNotAllowed(
                "This API key may use only some models, and /invocations always runs the "
                "engine's default model: use the OpenAI-compatible routes."
            )
        self._check_model(ex, body.get("model"))

    def _check_model(self, ex: Exchange, model: Any) -> None:
        """`model` (from a JSON body or a multipart form field, None when absent) must
        be served and allowed for the key; a key limited to some models must name one."""
        key = ex.key
        if model is None:
            # vLLM then serves its default model; a key limited to some models must name one.
            if key is not None and key.models is not None:
                raise ModelNotAllowed(
                    "This API key may use only some models: name one in 'model'.", param="model"
                )
            return
        if isinstance(model, str) and model not in self.pool.models and not self.pool.models_known:
            # No engine has listed its models yet (they are all down or starting): the
            # model may well be served, so "retry shortly", not "not served".
            raise NoEngineAvailable()
        if (
            not isinstance(model, str)
            or model not in self.pool.models
            or (key is not None and not key.allows_model(model))
        ):
            # The model name is not echoed: it is client text (`../x` and the like).
            raise ModelNotAllowed(
                "The model is not served here or not allowed for this API key.", param="model"
            )
        ex.model = model

    async def prepare_body(
        self, raw: bytes, body: dict[str, Any], ex: Exchange
    ) -> tuple[bytes, list[str]]:
        """The bytes to forward for a JSON request whose object `body` was parsed from
        `raw`, and the content hashes of its media items (for routing).

        The single place where request bodies are inspected or rewritten before they
        reach an engine. A body the inspector did not rewrite (no media, no client
        identifier to namespace) is forwarded as the client sent it, without re-encoding.
        """
        inspection = await self.inspector.inspect(body, ex.key)
        if inspection.changed:
            raw = orjson.dumps(body)
        return raw, inspection.digests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex: Exchange = scope[SCOPE_KEY]
        route = ex.route
        limits = self.settings.limits
        data: bytes | None = None
        parsed: dict[str, Any] | None = None
        media_hashes: list[str] = []
        if route.body is BodyKind.json:
            if not _is_json(_header(scope, b"content-type")):
                raise UnsupportedMediaType("This endpoint takes 'Content-Type: application/json'.")
            check_declared(scope["headers"], limits.max_body_bytes)
            raw = await read_body(receive, limits.max_body_bytes)
            ex.bytes_in = len(raw)
            try:
                loaded = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise InvalidJson("The request body is not valid JSON.") from None
            if not isinstance(loaded, dict):
                raise InvalidJson("The request body must be a JSON object.")
            parsed = loaded
            if route.path == _INVOCATIONS:
                self._check_invocation(ex, parsed)
            else:
                self._check_model(ex, parsed.get("model"))
            data, media_hashes = await self.prepare_body(raw, parsed, ex)
            content_type: tuple[bytes, bytes] | None = _JSON_CONTENT_TYPE
        elif route.body is BodyKind.multipart:
            # Read whole (capped) and validated before anything reaches an engine: the
            # upload is forwarded only when it is one well-formed audio file, its
            # `model` field checked like a JSON body's (vLLM resolves it the same way).
            check_declared(scope["headers"], limits.max_upload_bytes)
            raw = await read_body(receive, limits.max_upload_bytes)
            ex.bytes_in = len(raw)
            declared = _header(scope, b"content-type")
            upload = validate_upload(
                None if declared is None else declared.decode("latin-1"),
                raw,
                self.settings.media,
                max_file_bytes=limits.max_upload_bytes,
            )
            self._check_model(ex, upload.model)
            data = raw
            # The boundary the body was parsed with; validate_upload refused any other.
            content_type = (b"content-type", declared) if declared is not None else None
        else:
            content_type = None

        engines: Sequence[Engine] = self.pool.healthy() or self.pool.engines
        if not engines:
            raise NoEngineAvailable("No engine is configured.")
        if len(engines) == 1:
            # One candidate (the sidecar deployment): there is nothing to choose, so no
            # anchor is computed. The policy cost 9% of the CPU per request (py-spy).
            order: Sequence[Engine] = engines
        else:
            order = self._choose(scope, ex, parsed, media_hashes, engines)
        target = scope["gateway.path"]
        query: bytes = scope.get("query_string", b"")
        if query:
            target += "?" + query.decode("latin-1")
        headers = self._upstream_headers(scope, ex.request_id, content_type)

        loop = self.loop
        assert loop is not None, "the app's lifespan did not run"
        task = asyncio.current_task(loop)
        assert task is not None
        # The body is consumed: from now on `receive` only reports a disconnect.
        watch = DisconnectWatch(loop, receive, ex, task)
        try:
            await self._forward(scope, send, ex, order, target, headers, data, watch)
        except asyncio.CancelledError:
            if not ex.disconnected:
                raise
            # The client left: the upstream request was closed (the engine aborts it).
            task.uncancel()
        except ClientDisconnected:
            ex.disconnected = True
        finally:
            watch.stop()

    def _choose(
        self,
        scope: Scope,
        ex: Exchange,
        body: dict[str, Any] | None,
        media_hashes: list[str],
        engines: Sequence[Engine],
    ) -> list[Engine]:
        """The policy's order for this request; its decision goes on `ex` and the counts."""
        session: str | None = None
        if self._session_header is not None:
            value = _header(scope, self._session_header)
            if value:
                session = value.decode("latin-1")
        request = RoutingRequest(
            path=ex.route.path,
            body=body,
            media_hashes=media_hashes,
            key_name=ex.key_name,
            session=session,
        )
        order = self.policy.order(request, engines)
        ex.policy = self.policy.name
        ex.anchor_kind = request.anchor_kind
        ex.spilled = request.spilled
        if request.spilled:
            self._counts.spilled += 1
        else:
            self._counts.first += 1
        return order

    async def _forward(
        self,
        scope: Scope,
        send: Send,
        ex: Exchange,
        order: Sequence[Engine],
        target: str,
        headers: list[tuple[bytes, bytes]],
        data: bytes | None,
        watch: DisconnectWatch,
    ) -> None:
        upstream = self.upstream
        assert upstream is not None, "the app's lifespan did not run"
        group = ex.route.label
        method: str = scope["method"]
        pool = self.pool
        for attempt, engine in enumerate(order):
            if attempt:
                # The previous engine refused the connection: it received nothing, so
                # the request moves on (once per engine: `order` lists each once).
                ex.failovers = attempt
                self._counts.failovers += 1
            sent_at = time.perf_counter()
            engine.in_flight += 1
            try:
                resp = await upstream.request(self._origin(engine), method, target, headers, data)
            except ConnectFailed:
                # Nothing reached this engine: eject it and try the next one.
                engine.in_flight -= 1
                pool.eject(engine)
                continue
            except FirstByteTimeout:
                engine.in_flight -= 1
                ex.engine = engine.url
                pool.failed(engine)
                raise UpstreamTimeout("The engine did not start answering in time.") from None
            except UpstreamError:
                # The request was written, so it may have started: never retried.
                engine.in_flight -= 1
                ex.engine = engine.url
                pool.failed(engine)
                raise UpstreamUnavailable("The connection to the engine failed.") from None
            except BaseException:
                engine.in_flight -= 1
                raise
            ex.engine = engine.url
            ex.ttfb = time.perf_counter() - sent_at
            self.metrics.observe_ttfb(group, ex.ttfb)
            if resp.status >= 500:
                pool.failed(engine)
            elif engine.failures or engine.backoff:
                pool.succeeded(engine)
            try:
                key = ex.key
                if resp.status >= 400:
                    await self._relay_error(resp, send, ex, watch)
                elif ex.route.group is Group.models and key is not None and key.models is not None:
                    await self._relay_model_list(resp, send, ex, watch, key.models)
                else:
                    await self._relay(resp, send, ex, watch)
            finally:
                engine.in_flight -= 1
                # A response read to its end goes back to the pool; after a disconnect
                # or a broken stream the connection is closed, never reused half read.
                resp.close()
            return
        raise UpstreamUnavailable("No engine accepted the connection.")

    async def _read_error(self, resp: UpstreamResponse) -> bytes | None:
        """An error answer's body, or None when it is larger than `_ERROR_LIMIT` (the
        rest is left unread: the connection is then closed, never reused)."""
        length = resp.content_length
        if length is not None and length > _ERROR_LIMIT:
            return None
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._idle):
                while chunk := await resp.readany():
                    size += len(chunk)
                    if size > _ERROR_LIMIT:
                        return None
                    chunks.append(chunk)
        except UpstreamError:
            raise UpstreamBroken() from None
        except TimeoutError:
            raise UpstreamTimeout() from None
        return b"".join(chunks)

    async def _relay_error(
        self, resp: UpstreamResponse, send: Send, ex: Exchange, watch: DisconnectWatch
    ) -> None:
        """An engine's 4xx or 5xx, small or streamed: a 4xx JSON body keeps its shape
        with every string scrubbed of URLs and addresses; anything else (every 5xx, a
        4xx that is not JSON or is over the cap) is replaced by `EngineError`, and the
        engine's text goes to the log. No engine header is relayed with either."""
        body = await self._read_error(resp)
        watch.stop()
        status = resp.status
        if status < 500 and body is not None:
            cleaned = scrub_json(body)
            if cleaned is not None:
                ex.bytes_out = len(cleaned)
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(cleaned)).encode("ascii")),
                ]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": cleaned})
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

    async def _relay_model_list(
        self,
        resp: UpstreamResponse,
        send: Send,
        ex: Exchange,
        watch: DisconnectWatch,
        allowed: frozenset[str],
    ) -> None:
        """`GET /v1/models` for a key limited to some models: the engine's list with
        only those, so a key learns nothing of the models it may not use. An answer
        that cannot be read as a model list is refused, never passed on unfiltered."""
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._idle):
                while chunk := await resp.readany():
                    size += len(chunk)
                    if size > _MODEL_LIST_LIMIT:
                        raise UpstreamInvalid()
                    chunks.append(chunk)
        except UpstreamError:
            raise UpstreamBroken() from None
        except TimeoutError:
            raise UpstreamTimeout() from None
        watch.stop()
        body = b"".join(chunks)
        if resp.status == 200:
            try:
                listing = orjson.loads(body)
            except orjson.JSONDecodeError:
                raise UpstreamInvalid() from None
            models = listing.get("data") if isinstance(listing, dict) else None
            if not isinstance(models, list):
                raise UpstreamInvalid()
            listing["data"] = [m for m in models if isinstance(m, dict) and m.get("id") in allowed]
            body = orjson.dumps(listing)
        headers = [h for h in _response_headers(resp) if h[0].lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode("ascii")))
        ex.bytes_out = len(body)
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _relay(
        self,
        resp: UpstreamResponse,
        send: Send,
        ex: Exchange,
        watch: DisconnectWatch,
    ) -> None:
        out_headers = _response_headers(resp)
        length = resp.content_length
        if length is not None and length <= _SMALL_RESPONSE:
            try:
                # One timer, no asyncio.timeout context: this is the common path.
                body = await resp.read(self._idle)
            except UpstreamError:
                raise UpstreamBroken() from None
            watch.stop()
            ex.bytes_out = len(body)
            await send(
                {"type": "http.response.start", "status": resp.status, "headers": out_headers}
            )
            await send({"type": "http.response.body", "body": body})
            return

        await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
        loop = self.loop
        assert loop is not None
        try:
            async with asyncio.timeout(self._idle) as deadline:
                while True:
                    chunk = await resp.readany()
                    if not chunk:
                        break
                    ex.bytes_out += len(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    deadline.reschedule(loop.time() + self._idle)
        except (UpstreamError, TimeoutError) as exc:
            ex.code = "upstream_timeout" if isinstance(exc, TimeoutError) else UpstreamBroken.code
            log.warning("upstream_broken", request_id=ex.request_id, engine=ex.engine)
            if resp.content_type == "text/event-stream":
                # Never a silent truncation: SSE clients get an error frame, as vLLM
                # sends one for its own mid-stream errors, then the stream ends.
                error = UpstreamTimeout() if isinstance(exc, TimeoutError) else UpstreamBroken()
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
        await send({"type": "http.response.body", "body": b""})
