"""`create_app(settings)`: the middleware list, the dispatch, the lifespan.

The forwarding path is plain ASGI, not FastAPI routes: FastAPI's request handling cost
~200-270 us of CPU per request on this machine (docs/facts.md, "Measurements behind
design choices"). The gateway's own routes are a FastAPI application (control.py),
which `middleware.Front` hands only the requests the endpoint table marks `local`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import structlog
from pydantic import SecretStr

from gateway.access.admission import Admission
from gateway.access.api_keys import KeyRing
from gateway.access.clients import ClientAddresses
from gateway.access.throttle import FailureThrottle
from gateway.config.key_file import (
    ApiKey,
    KeyConfigError,
    build_keys,
    join_sources,
    load_key_file,
)
from gateway.config.settings import Settings, load_settings
from gateway.config.tls import client_context
from gateway.control import control_app
from gateway.errors import NoEngineAvailable
from gateway.exchange import exchange_of
from gateway.media.decoder import Decoder
from gateway.middleware import Front
from gateway.observability.logging import RequestLog, configure_logging
from gateway.observability.metrics import Metrics
from gateway.observability.multiprocess import MetricFiles, Workers
from gateway.payload.inspector import PayloadInspector
from gateway.proxy.handler import Proxy
from gateway.responses import send_json
from gateway.routing.key_errors import KeyErrors
from gateway.routing.policy import make_policy
from gateway.routing.pool import EnginePool
from gateway.server.limits import CONNECTION_GUARD, ConnectionGuard
from gateway.server.process import trim_periodically, tune_allocator, tune_collector
from gateway.store.client import StoreClient
from gateway.store.failures import SharedFailures
from gateway.store.limits import SharedLimits
from gateway.types import ASGIApp, Receive, Scope, Send
from gateway.upstream.client import Upstream
from gateway.upstream.interfaces import UpstreamClient

# The env var through which `vllm-gateway serve --workers N` hands each worker its
# config file (uvicorn starts workers from an import string, not an object).
CONFIG_ENV = "VLLM_GATEWAY_CONFIG"
KEY_FILE_POLL = 1.0

log = structlog.get_logger("gateway.app")


class ModelList:
    """`GET /v1/models`, answered from the pool's copy of the engines' lists
    (routing/models.py) rather than by an engine: one merged list, whichever engine
    serves what, and no engine request per call. Plain ASGI: clients call it like any
    API route."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.pool.ready():
            raise NoEngineAvailable()
        ex = exchange_of(scope)
        key = ex.key
        body = self.pool.index.listing(None if key is None else key.models)
        ex.bytes_out = len(body)
        await send_json(send, 200, body)


class KeyFileWatcher:
    """Reloads the key file when it changes: its modification time, its change time,
    its inode or its size. The change time is what a copy that keeps the source's mtime
    (`cp -p`, `rsync -a`, a Nix store path, mtime 1) cannot set back, so a key swapped
    for another of the same length is seen. An invalid new file is logged and ignored:
    the keys in force stay, so a typo cannot lock everyone out.

    A file is read only once it has held still for one poll: an editor or a script
    that truncates the file and then writes it would otherwise be caught half-way (an
    empty file reads as no keys at all and locks every client out until the next poll).
    An empty file is refused for the same reason; `api_keys: []` revokes every key on
    purpose. docs/facts.md, "Key file reloads", has what each rule answers."""

    def __init__(self, path: Path, keyring: KeyRing, settings: Settings, loaded_keys: int) -> None:
        self.path = path
        self.keyring = keyring
        self.settings = settings
        self._stamp = self._stat()
        # A change seen at the last poll, read once it is seen again unchanged.
        self._pending: tuple[int, int, int, int] | None = None
        # For /gateway/status (control.KeyFile): the last good load (the one before
        # this watcher started, of `loaded_keys` keys) and the last refused version.
        self.loaded_at = time.time()
        self.loaded_keys = loaded_keys
        self.refused_at: float | None = None

    def _stat(self) -> tuple[int, int, int, int] | None:
        """(mtime, ctime, inode, size) of the file the path names (links followed)."""
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size

    def poll(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            self._pending = None
            return
        if stamp is not None and stamp != self._pending:
            self._pending = stamp
            return
        self._pending = None
        self._stamp = stamp
        if stamp is not None and stamp[3] == 0:
            self.refused_at = time.time()
            log.error("key_file_invalid", path=str(self.path), reason="empty", kept="old keys")
            return
        try:
            keys, file_keys = load_keys(self.settings)
        except KeyConfigError as exc:
            self.refused_at = time.time()
            log.error("key_file_invalid", path=str(self.path), reason=str(exc), kept="old keys")
            return
        self.keyring.replace(keys)
        self.loaded_at, self.loaded_keys, self.refused_at = time.time(), file_keys, None
        log.info("key_file_reloaded", path=str(self.path), keys=len(keys))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(KEY_FILE_POLL)
            self.poll()


def load_keys(settings: Settings) -> tuple[tuple[ApiKey, ...], int]:
    """The keys `settings` configure (their own, then the key file's) and how many came
    from the file: what building the app checks beyond the settings' own validation,
    and what a key-file reload checks again. The file's unnamed keys are numbered on
    from the settings' own; a key or a name in both sources is refused (join_sources).
    Raises KeyConfigError for unusable keys."""
    keys = build_keys(settings.api_keys)
    path = settings.api_keys_file
    if path is None:
        return keys, 0
    from_file = load_key_file(path, first=len(settings.api_keys) + 1)
    return join_sources(keys, from_file, path), len(from_file)


class Gateway:
    """The ASGI application: the middleware stack for HTTP, and the lifespan.

    Every collaborator is built here, whole, from settings, or handed in (`upstream`:
    the client requests are forwarded with, a fake engine in tests). The lifespan
    starts the background work and owns everything that must be closed, in one
    `AsyncExitStack`: what started last is closed first."""

    def __init__(
        self, settings: Settings, *, upstream: UpstreamClient | None, workers: Workers
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        # With workers, this one's share of the metrics, copied where a scrape merges
        # every worker's (observability/multiprocess.py).
        self.workers = workers
        self.metric_files = (
            MetricFiles(self.metrics.registry, workers.directory)
            if workers.directory is not None
            else None
        )
        keys, file_keys = load_keys(settings)
        self.keyring = KeyRing(keys, allow_unauthenticated=settings.allow_unauthenticated)
        t = settings.timeouts
        # One client for everything sent to engines: forwarded requests, health checks,
        # model lists and load scrapes, under one TLS configuration.
        self.upstream: UpstreamClient = upstream or Upstream(
            connect_timeout=t.connect,
            # Bounds the wait for the response headers; the silence between body chunks
            # is bounded separately by `timeouts.idle`.
            first_byte_timeout=t.first_byte,
            keepalive=t.upstream_keepalive,
            ssl_context=client_context(settings.engine_ca_file)
            if settings.engine_ca_file is not None
            else None,
        )
        # The engine's own key, sent with everything that goes to an engine.
        engine_auth = engine_auth_headers(settings.upstream_api_key)
        self.pool = EnginePool(
            settings.engines,
            settings.routing,
            upstream=self.upstream,
            headers=engine_auth,
            served_models=settings.served_models,
        )
        self.decoder = Decoder(settings.media)
        budget = self.decoder.budget
        self.metrics.watch_decodes(
            lambda: budget.capacity - budget.available, lambda: budget.waiting
        )
        self.inspector = PayloadInspector(settings.media, settings.payload, decoder=self.decoder)
        # The one client of the shared store, for placements and limits (gateway/store/).
        self.store = (
            StoreClient(
                settings.store_url.get_secret_value(),
                prefix=settings.store_prefix,
                timeout=settings.store_timeout,
                retry=settings.store_retry,
            )
            if settings.store_url is not None
            else None
        )
        policy = make_policy(settings.routing, self.store)
        self.metrics.watch_pool(lambda: self.pool.engines, policy.name)
        if policy.store is not None:
            self.metrics.watch_store(policy.store)
        self.placements = policy.store
        # The limits of the client connections themselves, for the connection protocol
        # (gateway/server/protocol.py), which finds the guard in the lifespan state.
        self.connections = ConnectionGuard(
            settings.timeouts, settings.limits, self.metrics.connections
        )
        self.metrics.watch_connections(lambda: len(self.connections.open))
        # Per-key limits from authentication on (middleware.Front), the global slot once the
        # body is in (Proxy): one object, so the counts are the same ones.
        self.shared_limits = SharedLimits(self.store) if self.store is not None else None
        self.admission = Admission(settings.limits, self.metrics, shared=self.shared_limits)
        if self.store is not None:
            store, admission = self.store, self.admission
            self.metrics.watch_shared_store(lambda: store.up, lambda: admission.store_fallbacks)
        # Engine 5xx per key: a key past routing.key_errors is throttled (0: off); with
        # a store, counted across every process.
        routing = settings.routing
        key_errors = (
            KeyErrors(
                routing.key_errors,
                routing.key_errors_window,
                logger=structlog.get_logger("gateway.access"),
                shared=SharedFailures(self.store) if self.store is not None else None,
            )
            if routing.key_errors > 0
            else None
        )
        self.proxy = Proxy(
            settings,
            self.pool,
            policy,
            self.metrics,
            self.inspector,
            self.upstream,
            self.admission,
            self.connections,
            engine_auth=engine_auth,
            key_errors=key_errors,
        )
        self.watcher = (
            KeyFileWatcher(settings.api_keys_file, self.keyring, settings, file_keys)
            if settings.api_keys_file is not None
            else None
        )
        self._exit: contextlib.AsyncExitStack | None = None

        logger = structlog.get_logger("gateway")
        self.request_log = RequestLog(logger, settings.log_format, settings.log_level)
        self.clients = ClientAddresses(settings.trusted_proxies)
        # Failed authentications per client address; limits.auth_failures 0: off.
        limits = settings.limits
        self.throttle = (
            FailureThrottle(
                limits.auth_failures,
                limits.auth_failure_window,
                metrics=self.metrics,
                logger=structlog.get_logger("gateway.access"),
                # With a store, an address's failures count across every process.
                shared=SharedFailures(self.store) if self.store is not None else None,
            )
            if limits.auth_failures > 0
            else None
        )
        control = control_app(
            self.pool,
            self.metrics,
            self.keyring,
            policy=policy.name,
            key_file=self.watcher,
            public_metrics=settings.public_metrics,
            workers=workers.count,
            metric_files=self.metric_files,
        )
        # Everything before the handler, one layer (middleware.py).
        self.stack: ASGIApp = Front(
            proxy=self.proxy,
            local=control,
            models=ModelList(self.pool),
            metrics=self.metrics,
            logger=logger,
            request_log=self.request_log,
            max_headers=settings.limits.max_headers,
            keyring=self.keyring,
            admission=self.admission,
            public_metrics=settings.public_metrics,
            throttle=self.throttle,
            clients=self.clients,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self.stack(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            # WebSocket routes (/v1/realtime) are not proxied: refuse the handshake.
            await send({"type": "websocket.close", "code": 1008})

    async def startup(self) -> None:
        # Before the first image buffer: freed ones then go back to the system.
        tune_allocator()
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self.request_log.flush)
            if self.metric_files is not None:
                # Closed last: its final copy counts every request answered before.
                await stack.enter_async_context(self.metric_files.running())
            stack.callback(self.connections.stop)
            stack.push_async_callback(self.upstream.aclose)
            stack.push_async_callback(self.decoder.aclose)
            stack.push_async_callback(self.inspector.aclose)
            # The loop, looked up once and handed in: asyncio's lookup costs a getpid()
            # system call on Python 3.11. The connection guard keeps it for the body
            # reader and the proxy.
            loop = asyncio.get_running_loop()
            self.request_log.bind(loop)
            self.connections.start(loop)
            await self.pool.start()
            stack.push_async_callback(self.pool.stop)
            if self.store is not None:
                stack.push_async_callback(self.store.aclose)
            if self.placements is not None:
                # Before the first request: it would pay the connection and the script.
                await self.placements.warm()
            if self.shared_limits is not None:
                renewer = asyncio.create_task(self.shared_limits.run(), name="lease-renewal")
                stack.push_async_callback(_cancel, renewer)
            if self.watcher is not None:
                task = asyncio.create_task(self.watcher.run(), name="key-file")
                stack.push_async_callback(_cancel, task)
            trimmer = asyncio.create_task(trim_periodically(), name="malloc-trim")
            stack.push_async_callback(_cancel, trimmer)
            # Started whole: from here the stack is closed by `shutdown`.
            self._exit = stack.pop_all()
        log.info(
            "gateway_started",
            engines=len(self.pool.engines),
            healthy=len(self.pool.healthy()),
            keys=len(self.keyring.keys),
            engine_states=engine_states(self.pool),
        )

    async def shutdown(self) -> None:
        exit_stack, self._exit = self._exit, None
        if exit_stack is not None:
            await exit_stack.aclose()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state")
        if state is not None:
            state[CONNECTION_GUARD] = self.connections
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception:
                    log.exception("startup_failed")
                    await send({"type": "lifespan.startup.failed", "message": "startup failed"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def engine_states(pool: EnginePool) -> list[dict[str, Any]]:
    """Each engine's health and reason, for the start-up log lines (after the first
    checks: the pool's `start` runs them)."""
    return [
        {"engine": e.public_url, "healthy": e.healthy, "reason": e.reason} for e in pool.engines
    ]


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_app(
    settings: Settings, *, upstream: UpstreamClient | None = None, workers: Workers | None = None
) -> Gateway:
    """Build the gateway for `settings`, forwarding through `upstream` (default: the
    gateway's own keep-alive client), as one of `workers` (default: the only process).
    Raises KeyConfigError for unusable keys."""
    return Gateway(settings, upstream=upstream, workers=workers or Workers())


def app_from_env() -> Gateway:
    """uvicorn factory for `--workers N`: settings from the env and the config file."""
    config = os.environ.get(CONFIG_ENV)
    settings = load_settings(Path(config) if config else None)
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings, workers=Workers.from_env(os.environ))
    tune_collector()
    return app


def engine_auth_headers(key: SecretStr | None) -> list[tuple[bytes, bytes]]:
    """The headers that carry the engine's own key (`upstream_api_key`) to it: the one
    place they are built, for forwarded requests and the pool's checks alike."""
    if key is None:
        return []
    return [(b"authorization", f"Bearer {key.get_secret_value()}".encode())]
