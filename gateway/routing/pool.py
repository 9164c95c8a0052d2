"""The engine pool: the configured engines, their health, load and served models.

- Engines come from `GATEWAY_ENGINES`: URLs, and `dns+http://name:port` entries resolved
  every `routing.dns_interval` seconds to one engine per address (dns.py); such an
  engine keeps the entry's name for its Host header and TLS server name.
- Health is checked actively (GET /health every `routing.health_interval`) and
  passively: an engine that refuses a connection is ejected at once, and a run of
  `routing.eject_after_5xx` failed requests in a row ejects it once the run spans the
  requests of `routing.eject_keys` keys. Ejection lasts a back-off that doubles while
  the engine keeps failing; it comes back when a health check passes after the
  back-off. One key's requests can fail on their content or size (vLLM answers 501 for
  a route its model does not serve, 500 for some inputs; a generation long enough
  outlasts `timeouts.first_byte`): that key is throttled (key_errors.py), the engine
  stays. A 501 never counts at all. A check that times out while the
  engine answers requests of this process keeps it in rotation for `routing.busy_grace`
  seconds of timeouts in a row (vLLM parses a body on its server's event loop, and one
  large body can hold its /health answer for seconds); an idle engine is taken out. The
  last engine in rotation for its models is never taken out by a timeout while it
  answers requests (checks.py, `_busy`). An engine whose run holds a request it never
  answered (a timeout, an answer broken off) is not answering: a check that times out
  then takes it out, busy or last.
- An engine is healthy only once its served models are known (GET /v1/models), so a
  ready gateway never refuses a served model as unknown. Models are read again every
  `routing.models_interval` seconds. `index` (models.py) says which healthy engines
  serve each model; it is rebuilt whenever an engine's health or models change.
- Each engine out of rotation has a reason (health.py: a stable `reason`, a `detail`);
  a change of health or reason is logged once, as `engine_health`.
- Load: `in_flight` counts what this process forwards; every `routing.load_interval`
  seconds `running` and `waiting` are read from the engine's own /metrics
  (engine_load.py): what every replica and worker process sends it, and sees alike.

The checks themselves (health, model lists, load scrapes) are checks.py's; the pool
decides when they run and rebuilds `index` from what they find. An engine and a
request's hold on it: engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import structlog

from gateway.routing.checks import EngineChecks, judge
from gateway.routing.dns import DnsEntry, NameNotFound, Resolver, is_dns_entry, resolve
from gateway.routing.engine import Engine
from gateway.routing.health import DNS_FAILED, DNS_NO_ADDRESSES, Verdict, ejected_verdict
from gateway.routing.models import ModelIndex
from gateway.routing.settings import RoutingSettings
from gateway.upstream.errors import UpstreamError
from gateway.upstream.interfaces import UpstreamClient

# While no engine is ready, health checks run at least this often, so a gateway that
# started before its engines (or whose first model listing failed) turns ready soon.
NOT_READY_INTERVAL = 0.25
# vLLM answers 501 for a route its model does not serve (NotImplementedError, e.g.
# /v1/systemone on every architecture but six): a property of the request, not the engine.
NOT_IMPLEMENTED = 501

log = structlog.get_logger("gateway.pool")


class EnginePool:
    """Engines from settings. `start` resolves names and runs the checks; `stop` ends them.

    `upstream` sends the checks (the client requests are forwarded with); `headers` go
    with each (the engine key). `served_models` are served by every engine besides
    what each lists. `resolver` looks up a DNS entry's addresses (default: the system
    resolver, A and AAAA); it raises NameNotFound for a name without addresses.
    """

    def __init__(
        self,
        entries: Sequence[str],
        settings: RoutingSettings,
        *,
        upstream: UpstreamClient,
        headers: Sequence[tuple[bytes, bytes]] = (),
        served_models: Iterable[str] = (),
        on_health: Callable[[Engine], None] | None = None,
        resolver: Resolver = resolve,
    ) -> None:
        self._settings = settings
        self._checks = EngineChecks(settings, upstream, headers, sole=self._sole)
        self._on_health = on_health
        self._resolver = resolver
        self._static: list[Engine] = []
        self._dns: list[DnsEntry] = []
        for spec in entries:
            if is_dns_entry(spec):
                self._dns.append(DnsEntry(spec))
            else:
                self._static.append(Engine(spec))
        # Engines of each DNS entry, by URL, from its last good resolution.
        self._resolved: dict[str, dict[str, Engine]] = {e.spec: {} for e in self._dns}
        # Why each DNS entry yields no fresh engines (None: its last lookup answered).
        self.dns_reasons: dict[str, Verdict | None] = {e.spec: None for e in self._dns}
        self.engines: list[Engine] = list(self._static)
        self._tasks: list[asyncio.Task[None]] = []
        self._healthy: list[Engine] = []
        self.extra_models = frozenset(served_models)
        self.index = ModelIndex(self.engines, self.extra_models)

    def healthy(self) -> list[Engine]:
        """Engines that passed their last health check, in configuration order."""
        return self._healthy

    def ready(self) -> bool:
        """At least one engine is healthy, so its served models are known."""
        return bool(self._healthy)

    def _sole(self, engine: Engine) -> bool:
        """Whether no other engine in rotation serves any of `engine`'s models."""
        others = [e for e in self._healthy if e is not engine]
        if not others:
            return True
        if self.extra_models:
            return False
        models = engine.models
        return not any(e.models & models for e in others)

    def _changed(self, engine: Engine | None = None) -> None:
        self._healthy = [e for e in self.engines if e.healthy]
        self.index = ModelIndex(self.engines, self.extra_models)
        if engine is not None and self._on_health is not None:
            self._on_health(engine)

    # -- passive checks (called by the proxy) ------------------------------------------

    def eject(
        self, engine: Engine, reason: str = "connect_failed", error: UpstreamError | None = None
    ) -> None:
        """Take `engine` out of the rotation for its back-off (doubling each time it is
        ejected again before it answers well). `reason`: "connect_failed" (`error`, when
        known, says how) or "5xx"."""
        if not engine.healthy:
            return
        s = self._settings
        engine.backoff = min(max(engine.backoff * 2, s.eject_backoff), s.eject_backoff_max)
        engine.ejected_until = time.monotonic() + engine.backoff
        engine.ejections += 1
        after = engine.failures if reason == "5xx" else None
        _end_run(engine)
        judge(engine, ejected_verdict(error, after_5xx=after, backoff=engine.backoff))
        self._changed(engine)

    def failed(self, engine: Engine, key: str, status: int | None = None) -> None:
        """A request of the key named `key` ("" for callers without a key) failed at
        `engine`: it answered `status` (5xx), or (`status` None) it did not answer in
        time or broke its answer off. A run of them ejects it once it spans
        `eject_keys` keys. A timeout counts like a 5xx: one key's request can outlast
        `timeouts.first_byte` by its own size (a long generation), so one key's
        timeouts say nothing of the engine; one that is silent for every key fails its
        health check, which then takes it out (checks.py, `_busy`). A 501 (the engine
        does not serve that route for its model) is not a failure of the engine and
        does not count."""
        if status == NOT_IMPLEMENTED:
            return
        s = self._settings
        engine.failures += 1
        if status is None:
            engine.unanswered = True
        if len(engine.failing_keys) < s.eject_keys:
            engine.failing_keys.add(key)
        if engine.failures >= s.eject_after_5xx and len(engine.failing_keys) >= s.eject_keys:
            self.eject(engine, reason="5xx")

    @staticmethod
    def succeeded(engine: Engine) -> None:
        """The engine answered below 500: its run of failures and its back-off end."""
        _end_run(engine)
        engine.backoff = 0.0

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve names and check every engine once (so a ready gateway knows its
        models), then keep doing so in the background."""
        await self.resolve_all()
        await self.check_all()
        if self._settings.load_interval > 0:
            await self.scrape_all()
        self._spawn(self._health_loop(), "engine-health")
        if self._dns:
            self._spawn(self._every(self._settings.dns_interval, self._refresh_dns), "engine-dns")
        if self._settings.load_interval > 0:
            self._spawn(self._every(self._settings.load_interval, self.scrape_all), "engine-load")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _health_loop(self) -> None:
        while True:
            interval = self._settings.health_interval
            if not self._healthy:
                interval = min(interval, NOT_READY_INTERVAL)
            await asyncio.sleep(interval)
            await _round(self.check_all)

    @staticmethod
    async def _every(interval: float, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            await _round(job)

    # -- DNS entries -----------------------------------------------------------------------

    async def resolve_all(self) -> bool:
        """Resolve every DNS entry; True when the engines changed."""
        if not self._dns:
            return False
        results = await asyncio.gather(*(self._resolve(e) for e in self._dns))
        if not any(results):
            return False
        engines = list(self._static)
        for entry in self._dns:
            engines.extend(self._resolved[entry.spec].values())
        self.engines = engines
        self._changed()
        return True

    async def _refresh_dns(self) -> None:
        if await self.resolve_all():
            # A new engine joins the rotation at its first good check: check now rather
            # than after the next health interval.
            await asyncio.gather(*(self._check(e) for e in self.engines if e.models_at == 0))

    async def _resolve(self, entry: DnsEntry) -> bool:
        """Update the engines of `entry`; True when the set of addresses changed."""
        try:
            addresses = await self._resolver(entry.host, entry.port)
        except NameNotFound:
            addresses = []
        except OSError:
            self._dns_state(entry, DNS_FAILED)
            return False
        self._dns_state(entry, None if addresses else DNS_NO_ADDRESSES)
        old = self._resolved[entry.spec]
        urls = [entry.url(a) for a in addresses]
        if set(urls) == set(old):
            return False
        new = {url: old.get(url) or Engine(url, entry.host) for url in urls}
        gone = [url for url in old if url not in new]
        added = [url for url in new if url not in old]
        log.info("engine_dns_changed", entry=entry.spec, added=added, removed=gone)
        self._resolved[entry.spec] = new
        return True

    def _dns_state(self, entry: DnsEntry, verdict: Verdict | None) -> None:
        """Record why `entry` yields no fresh engines, logging it once when it changes."""
        if self.dns_reasons[entry.spec] == verdict:
            return
        self.dns_reasons[entry.spec] = verdict
        kept = len(self._resolved[entry.spec])
        if verdict is None:
            log.info("engine_dns", entry=entry.spec, reason=None)
        else:
            log.warning(
                "engine_dns",
                entry=entry.spec,
                reason=verdict.reason,
                detail=verdict.detail,
                kept=kept,
            )

    # -- active checks (checks.py) ----------------------------------------------------------

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.engines))

    async def _check(self, engine: Engine) -> None:
        if await self._checks.check(engine):
            self._changed(engine)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._checks.scrape(e) for e in self._healthy))


def _end_run(engine: Engine) -> None:
    engine.failures = 0
    engine.unanswered = False
    if engine.failing_keys:
        engine.failing_keys.clear()


async def _round(job: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """One round of a background loop. An unexpected failure is logged, under the name
    `_spawn` gave the loop's task, and the next round runs: escaping, it would end the
    task, and the checks with it, silently."""
    try:
        await job()
    except Exception:
        task = asyncio.current_task()
        log.exception("engine_loop_failed", loop=task.get_name() if task else None)
