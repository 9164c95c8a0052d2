"""The active checks of one engine: GET /health, its models (GET /v1/models) and its
load (GET /metrics), through the upstream client requests are forwarded with
(gateway/upstream/client.py): one client, one TLS configuration for everything sent to
engines. Each verdict is recorded on the engine (`judge`) and logged once when it
changes; when to check, and what follows from a change, is the pool's (pool.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog

from gateway.routing.engine import Engine
from gateway.routing.engine_load import parse_load
from gateway.routing.health import (
    HEALTH_PATH,
    MODELS_EMPTY,
    MODELS_PATH,
    TIMEOUT,
    Verdict,
    error_verdict,
    status_verdict,
    unreadable_models,
)
from gateway.routing.model_list import ModelList, parse_model_list
from gateway.routing.settings import RoutingSettings
from gateway.upstream.errors import FirstByteTimeout, ReadTimeout, UpstreamError
from gateway.upstream.interfaces import UpstreamClient

log = structlog.get_logger("gateway.pool")


class EngineChecks:
    """Checks engines through `upstream`; `headers` go with each request (the engine
    key), and a 401 or 403 names the key in its reason when they carry one."""

    def __init__(
        self,
        settings: RoutingSettings,
        upstream: UpstreamClient,
        headers: Sequence[tuple[bytes, bytes]],
        sole: Callable[[Engine], bool] = lambda engine: False,
    ) -> None:
        self._settings = settings
        # Whether an engine is the last in rotation for its models (the pool knows).
        self._sole = sole
        self._upstream = upstream
        self._headers = list(headers)
        # Whether the engine key goes with each request (health reasons name it).
        self._keyed = any(name.lower() == b"authorization" for name, _ in self._headers)

    async def check(self, engine: Engine) -> bool:
        """Check `engine` (GET /health, and its models when due) and record the verdict;
        True when its health or models changed. An ejected engine is not tried before
        its back-off ends."""
        if not engine.healthy and time.monotonic() < engine.ejected_until:
            return False
        verdict: Verdict | None = None
        answer = await self._probe(engine, HEALTH_PATH)
        if isinstance(answer, Verdict):
            verdict = answer
        elif answer[0] != 200:
            verdict = status_verdict(HEALTH_PATH, answer[0], keyed=self._keyed)
        if self._busy(engine, verdict):
            return False
        models_changed = False
        refresh = self._settings.models_interval
        due = not engine.healthy or time.monotonic() - engine.models_at > refresh
        if verdict is None and due:
            listing = await self._models(engine)
            if isinstance(listing, ModelList):
                # vLLM stamps each entry with the time of the listing: a new list
                # rebuilds the index (cheap, every models_interval): its answers stay fresh.
                models_changed = True
                engine.listing = listing
                engine.models_at = time.monotonic()
                if engine.stale is not None:
                    engine.stale = None
                    log.info("engine_models_stale", engine=engine.public_url, reason=None)
            elif not engine.healthy or listing.reason == "upstream_key_refused":
                # Healthy needs known models: a gateway that routed to an engine before
                # knowing what it serves would refuse its models as not served (404
                # model_not_found). A refused key fails every request: out of rotation.
                verdict = listing
            elif listing != engine.stale:
                # A healthy engine keeps its last good list through a failed re-read.
                engine.stale = listing
                log.warning(
                    "engine_models_stale",
                    engine=engine.public_url,
                    reason=listing.reason,
                    detail=listing.detail,
                )
        health_changed = judge(engine, verdict)
        return health_changed or models_changed

    def _busy(self, engine: Engine, verdict: Verdict | None) -> bool:
        """True when `verdict` is a timeout that leaves `engine` in rotation (logged once
        per run of them): it is healthy, and either has requests of this process in
        flight while its checks have timed out for less than `routing.busy_grace`
        seconds in a row, or is the last engine in rotation for its models and still
        answers requests (one in flight, or one answered below 500 within busy_grace).
        Slowness alone never takes out the last engine that answers: without it every
        request is refused 503, where a slow answer is still an answer (a starved
        engine took over 1 s to answer /health while it served every request).
        An engine whose run of failures holds a request it never answered (a timeout,
        since its last answer below 500) is not answering: one key's timeouts do not
        eject (pool.py, `failed`), so a silent engine goes out here."""
        if verdict is None or verdict.reason != TIMEOUT or not engine.healthy:
            engine.slow_since = None
            return False
        now = time.monotonic()
        grace = self._settings.busy_grace
        answering = not engine.unanswered and (
            engine.in_flight > 0 or now - engine.answered_at < grace
        )
        if not answering:
            engine.slow_since = None
            return False
        if engine.slow_since is None:
            engine.slow_since = now
            log.info(
                "engine_health_slow",
                engine=engine.public_url,
                in_flight=engine.in_flight,
                detail=verdict.detail,
            )
        if self._sole(engine):
            return True
        return engine.in_flight > 0 and now - engine.slow_since < grace

    async def _models(self, engine: Engine) -> ModelList | Verdict:
        """The engine's model list, or why it could not be read."""
        answer = await self._probe(engine, MODELS_PATH)
        if isinstance(answer, Verdict):
            return answer
        status, body = answer
        if status != 200:
            return status_verdict(MODELS_PATH, status, keyed=self._keyed)
        listing = parse_model_list(body)
        if listing is None:
            return unreadable_models(body)
        if not listing.ids:
            return MODELS_EMPTY
        return listing

    async def _get(self, engine: Engine, path: str) -> tuple[int, bytes]:
        """GET `path` and its whole answer within `routing.health_timeout`. Raises
        UpstreamError or TimeoutError."""
        limit = self._settings.health_timeout
        async with asyncio.timeout(limit):
            resp = await self._upstream.request(engine.origin, "GET", path, self._headers, None)
            try:
                return resp.status, await resp.read(limit)
            finally:
                resp.close()

    async def _probe(self, engine: Engine, path: str) -> tuple[int, bytes] | Verdict:
        """GET `path`: the status and body, or why there was no answer. A check that
        times out is sent once more before it counts: the timer also runs out while this
        process's own event loop is held (a large body parsed on it), which says nothing
        about the engine; an engine that is really silent times out twice."""
        try:
            return await self._get(engine, path)
        except (TimeoutError, FirstByteTimeout, ReadTimeout):
            pass
        except UpstreamError as exc:
            return error_verdict(exc, path, self._settings.health_timeout)
        try:
            return await self._get(engine, path)
        except (UpstreamError, TimeoutError) as exc:
            return error_verdict(exc, path, self._settings.health_timeout)

    async def scrape(self, engine: Engine) -> None:
        """Read `engine`'s own load from its /metrics (engine_load.py); unknown when that
        fails."""
        in_flight, sent = engine.in_flight, engine.sent
        try:
            status, body = await self._get(engine, "/metrics")
        except (UpstreamError, TimeoutError):
            status, body = 0, b""
        load = parse_load(body) if status == 200 else None
        if load is None:
            # Unknown is not busy: fall back to this process's own count.
            engine.running, engine.waiting, engine.kv_cache_usage = 0, 0, 0.0
            engine.scraped = False
            return
        engine.running, engine.waiting, engine.kv_cache_usage = (
            load.running,
            load.waiting,
            load.kv_cache_usage,
        )
        engine.scraped = True
        engine.mine_at_scrape = in_flight + engine.sent - sent
        if load.recomputed is not None:
            engine.recomputed.observe(load.recomputed, time.monotonic(), self._settings.store_decay)


def judge(engine: Engine, verdict: Verdict | None) -> bool:
    """Record `engine`'s state (`verdict` None: healthy), logging it once when it
    changes; True when its health changed."""
    reason = None if verdict is None else verdict.reason
    detail = None if verdict is None else verdict.detail
    healthy = verdict is None
    if (healthy, reason, detail) == (engine.healthy, engine.reason, engine.detail):
        return False
    changed = healthy != engine.healthy
    engine.healthy, engine.reason, engine.detail = healthy, reason, detail
    engine.since = time.time()
    if healthy:
        log.info("engine_health", engine=engine.public_url, healthy=True, reason=None)
    else:
        log.warning(
            "engine_health",
            engine=engine.public_url,
            healthy=False,
            reason=reason,
            detail=detail,
        )
    return changed
