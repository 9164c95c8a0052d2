"""The engine pool: the configured engines, their health, load and served models.

Health is checked actively (GET /health every `routing.health_interval`) and passively:
a connection the engine refuses ejects it at once, until its next good health check.
Served models are learned from each engine's /v1/models when it turns healthy and
then every `MODELS_REFRESH` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import orjson
import structlog

from gateway.routing.settings import RoutingSettings

MODELS_REFRESH = 15.0

log = structlog.get_logger("gateway.pool")


class Engine:
    """One engine. `in_flight` counts requests the gateway is forwarding to it."""

    __slots__ = ("healthy", "in_flight", "models", "models_at", "url")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = False
        self.in_flight = 0
        self.models: frozenset[str] = frozenset()
        self.models_at = 0.0

    def __repr__(self) -> str:
        return f"Engine({self.url!r}, healthy={self.healthy}, in_flight={self.in_flight})"


class EnginePool:
    """Engines from settings. `start` runs the health checks; `stop` ends them."""

    def __init__(
        self,
        urls: Sequence[str],
        settings: RoutingSettings,
        *,
        headers: Mapping[str, str] | None = None,
        on_health: Callable[[Engine], None] | None = None,
    ) -> None:
        self.engines: list[Engine] = [Engine(u) for u in urls]
        self._settings = settings
        self._headers = dict(headers or {})
        self._on_health = on_health
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._healthy: list[Engine] = []
        self.extra_models: frozenset[str] = frozenset()
        self.models: frozenset[str] = frozenset()

    def healthy(self) -> list[Engine]:
        """Engines that passed their last health check, in configuration order."""
        return self._healthy

    def _changed(self, engine: Engine) -> None:
        self._healthy = [e for e in self.engines if e.healthy]
        # Models of engines that are down stay known: a request for them should get
        # 502 from the dead engine's failover, not a misleading 403.
        self.models = self.extra_models.union(*(e.models for e in self.engines))
        if self._on_health is not None:
            self._on_health(engine)

    def eject(self, engine: Engine) -> None:
        """Passive check: the engine refused a connection. Back after a good check."""
        if engine.healthy:
            engine.healthy = False
            log.warning("engine_ejected", engine=engine.url, reason="connect_failed")
            self._changed(engine)

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Check every engine once (so a ready gateway knows its models), then poll."""
        self._session = session
        await self.check_all()
        self._task = asyncio.create_task(self._run(), name="engine-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.health_interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.engines))

    async def _get(self, engine: Engine, path: str) -> tuple[int, bytes]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self._settings.health_timeout)
        async with self._session.get(
            engine.url + path, headers=self._headers, timeout=timeout, allow_redirects=False
        ) as resp:
            return resp.status, await resp.read()

    async def _check(self, engine: Engine) -> None:
        try:
            status, _ = await self._get(engine, "/health")
            ok = status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        models_changed = False
        if ok and (not engine.healthy or time.monotonic() - engine.models_at > MODELS_REFRESH):
            models = await self._models(engine)
            if models is not None:
                models_changed = models != engine.models
                engine.models = models
                engine.models_at = time.monotonic()
        if ok != engine.healthy or models_changed:
            if ok != engine.healthy:
                log.info("engine_health", engine=engine.url, healthy=ok)
            engine.healthy = ok
            self._changed(engine)

    async def _models(self, engine: Engine) -> frozenset[str] | None:
        try:
            status, body = await self._get(engine, "/v1/models")
            if status != 200:
                return None
            data: Any = orjson.loads(body)
            return frozenset(
                str(m["id"]) for m in data.get("data", []) if isinstance(m, dict) and "id" in m
            )
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            log.warning("engine_models_unreadable", engine=engine.url)
            return None
