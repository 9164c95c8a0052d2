"""The simulated engine as a plain ASGI app: a dict router, vLLM's auth rule, counters.

Per request: count it under its route (`sim:received_requests_total`), record it when
`--record-requests` is on, apply `--api-key` the way vLLM does, then run the handler. In
calibrated mode the handler runs as a task raced against the client's disconnect, so a
client that goes away aborts the simulated request, as it does in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

from bench.sim import admin, anthropic, decisions, generate, pooling, speech
from bench.sim.config import SimConfig
from bench.sim.engine import Engine
from bench.sim.errors import UNAUTHORIZED_BODY, SimError, invalid_body
from bench.sim.guard import media_client
from bench.sim.http import (
    JSON,
    ClientGone,
    Message,
    Receive,
    Request,
    Scope,
    Send,
    read_body,
    respond,
    wait_disconnect,
)
from bench.sim.media import MediaConnector
from bench.sim.responses import ResponseStore

Handler = Callable[[Engine, Request], Coroutine[Any, Any, None]]

# vLLM's auth middleware guards a path only when the raw path starts with one of these
# (vllm/entrypoints/serve/middleware/authenticate.py); everything else stays open
# (docs/vllm.md).
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
RECORDER_PATH = "/sim/requests"
# PUT a number of seconds: every GET /health waits that long before answering (0: not).
HEALTH_DELAY_PATH = "/sim/health-delay"
ADAPTERS_PREFIX = "/adapters/"


async def invocations(engine: Engine, req: Request) -> None:
    """SageMaker's entry point: vLLM picks the handler by the body's shape."""
    body = req.json()
    if engine.config.runner == "generate":
        if "messages" in body:
            return await generate.chat(engine, req)
        if "prompt" in body:
            return await generate.completions(engine, req)
    else:
        for key, handler in pooling.INVOCATION_KEYS:
            if key in body:
                return await handler(engine, req)
    raise invalid_body("Cannot find suitable handler for request.")


def routes(
    config: SimConfig, responses: ResponseStore | None = None
) -> dict[str, dict[str, Handler]]:
    table: dict[str, dict[str, Handler]] = {
        "/health": {"GET": admin.health},
        "/ping": {"GET": admin.health, "POST": admin.health},
        "/version": {"GET": admin.version},
        "/load": {"GET": admin.load},
        "/metrics": {"GET": admin.metrics},
        "/v1/models": {"GET": admin.models},
        "/tokenize": {"POST": generate.tokenize},
        "/detokenize": {"POST": generate.detokenize},
        "/invocations": {"POST": invocations},
    }
    if config.runner == "generate":
        table["/v1/chat/completions"] = {"POST": generate.chat}
        table["/v1/completions"] = {"POST": generate.completions}
        table["/v1/audio/transcriptions"] = {"POST": speech.transcriptions}
        table["/v1/audio/translations"] = {"POST": speech.translations}
        table["/v1/messages"] = {"POST": anthropic.messages}
        table["/v1/systemone"] = {"POST": decisions.decide}
        if responses is not None:
            table["/v1/responses"] = {"POST": responses.create}
    else:
        table["/v1/embeddings"] = {"POST": pooling.embeddings}
        table["/pooling"] = {"POST": pooling.pooling}
        table["/classify"] = {"POST": pooling.classify}
        for path in ("/score", "/v1/score"):
            table[path] = {"POST": pooling.score}
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            table[path] = {"POST": pooling.rerank}
    if config.enable_runtime_lora:
        table["/v1/load_lora_adapter"] = {"POST": admin.load_lora}
        table["/v1/unload_lora_adapter"] = {"POST": admin.unload_lora}
        table["/adapters"] = {"POST": admin.load_lora}
    for path in config.not_implemented:
        table[path] = {"POST": admin.not_implemented}
    return table


class SimApp:
    """One simulated engine. Owns its engine state and its media HTTP client."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        # vLLM's response store, and the routes that use it (--enable-responses-api-store).
        self.responses = (
            ResponseStore()
            if config.enable_responses_api_store and config.runner == "generate"
            else None
        )
        self.routes = routes(config, self.responses)
        self.recorder = admin.Recorder(config.record_requests) if config.record_requests else None
        # Like vLLM's MediaConnector, but on loopback only unless --allow-remote-media.
        self.client = media_client(config.allow_remote_media)
        media = MediaConnector(
            self.client,
            config.model,
            config.allowed_media_domains,
            config.allowed_local_media_path,
        )
        self.engine = Engine(config, media)
        # Seconds each GET /health waits (HEALTH_DELAY_PATH): a starved engine.
        self.health_delay = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _lookup(self, path: str) -> tuple[str, dict[str, Handler] | None]:
        table = self.routes.get(path)
        if table is not None:
            return path, table
        if self.config.enable_runtime_lora and path.startswith(ADAPTERS_PREFIX):
            return "/adapters/{name}", {"DELETE": admin.delete_adapter}
        if self.responses is not None and (found := self.responses.lookup(path)) is not None:
            label, method = found
            store = self.responses
            return label, {method: store.retrieve if method == "GET" else store.cancel}
        return "unmatched", None

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        metrics = self.engine.metrics
        is_recorder = self.recorder is not None and path == RECORDER_PATH
        label, table = self._lookup(path)
        if not (is_recorder or path == HEALTH_DELAY_PATH):
            metrics.received[label] = metrics.received.get(label, 0) + 1
        try:
            body = await read_body(receive, self.config.max_body_bytes)
        except ClientGone:
            return
        except SimError as exc:
            await respond(send, exc.status, exc.body(), JSON)
            return
        if self.config.loop_hold_per_mib and body:
            # Blocking on purpose: what a server parsing on its event loop does.
            time.sleep(len(body) / 2**20 * self.config.loop_hold_per_mib)  # noqa: ASYNC251
        req = Request(method, path, scope["query_string"], scope["headers"], body, receive, send)
        if is_recorder:
            assert self.recorder is not None
            await self.recorder.serve(req)
            return
        if path == HEALTH_DELAY_PATH and method == "PUT":
            self.health_delay = min(max(float(body or b"0"), 0.0), 600.0)
            await respond(send, 200, b"", None)
            return
        if path == "/health" and self.health_delay:
            await asyncio.sleep(self.health_delay)
        if self.recorder is not None:
            self.recorder.add(req)
        if self.config.api_key and method != "OPTIONS" and path.startswith(GUARDED_PREFIXES):
            given = req.header(b"authorization") or ""
            expected = f"Bearer {self.config.api_key}"
            if not secrets.compare_digest(given.encode(), expected.encode()):
                await respond(send, 401, UNAUTHORIZED_BODY)
                return
        if table is None:
            await respond(send, 404, SimError(404, "Not Found").body())
            return
        handler = table.get(method)
        if handler is None:
            await respond(send, 405, SimError(405, "Method Not Allowed").body())
            return
        if self.config.zero:
            await self._run(handler, req)
        else:
            await self._run_abortable(handler, req)

    async def _run(self, handler: Handler, req: Request) -> None:
        started = _Started(req.send)
        req.send = started
        try:
            await handler(self.engine, req)
        except SimError as exc:
            if not started.started:
                await respond(started.inner, exc.status, exc.body())
        except OSError:
            # uvicorn raises ClientDisconnected (an OSError) when writing to a closed
            # connection: the client left mid-stream.
            self.engine.metrics.aborted += 1

    async def _run_abortable(self, handler: Handler, req: Request) -> None:
        work = asyncio.ensure_future(self._run(handler, req))
        gone = asyncio.ensure_future(wait_disconnect(req.receive))
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            work.result()
            return
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        self.engine.metrics.aborted += 1


class _Started:
    """A send wrapper that remembers whether the response has started."""

    __slots__ = ("inner", "started")

    def __init__(self, inner: Send) -> None:
        self.inner = inner
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.inner(message)
