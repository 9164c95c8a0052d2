"""The engine pool: the configured engines, their health, load and served models.

- Engines come from `GATEWAY_ENGINES`: URLs, and `dns+http://name:port` entries resolved
  every `routing.dns_interval` seconds to one engine per address (dns.py); such an
  engine keeps the entry's name for its Host header and TLS server name.
- Health is checked actively (GET /health every `routing.health_interval`) and
  passively: an engine that refuses a connection, or answers `routing.eject_after_5xx`
  5xx in a row, is ejected for a back-off that doubles while it keeps failing, and comes
  back when a health check passes after the back-off. A check that times out while the
  engine answers requests of this process keeps it in rotation for `routing.busy_grace`
  seconds of timeouts in a row (vLLM parses a body on its server's event loop, and one
  large body can hold its /health answer for seconds); an idle engine is taken out.
- An engine is healthy only once its served models are known (GET /v1/models), so a
  ready gateway never refuses a served model as unknown. Models are read again every
  `routing.models_interval` seconds. `index` (models.py) says which healthy engines
  serve each model; it is rebuilt whenever an engine's health or models change.
- Each engine out of rotation has a reason (health.py: a stable `reason`, a `detail`);
  a change of health or reason is logged once, as `engine_health`.
- Load: `in_flight` counts what this process forwards; every `routing.load_interval`
  seconds `running` and `waiting` are read from the engine's own /metrics
  (engine_load.py): what every replica and worker process sends it, and sees alike.

Checks, model lists and scrapes go through the upstream client requests are forwarded
with (gateway/upstream/client.py): one client, one TLS configuration for everything sent to
engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import structlog

from gateway.routing.dns import DnsEntry, NameNotFound, Resolver, is_dns_entry, resolve
from gateway.routing.engine_load import parse_load
from gateway.routing.health import (
    DNS_FAILED,
    DNS_NO_ADDRESSES,
    HEALTH_PATH,
    INVALID_URL,
    MODELS_EMPTY,
    MODELS_PATH,
    NOT_CHECKED,
    TIMEOUT,
    Verdict,
    ejected_verdict,
    error_verdict,
    status_verdict,
    unreadable_models,
)
from gateway.routing.models import ModelIndex, ModelList, parse_model_list
from gateway.routing.settings import RoutingSettings
from gateway.upstream.client import ConnectFailed, Origin, UpstreamClient, UpstreamError

# While no engine is ready, health checks run at least this often, so a gateway that
# started before its engines (or whose first model listing failed) turns ready soon.
NOT_READY_INTERVAL = 0.25

log = structlog.get_logger("gateway.pool")


class Engine:
    """One engine. `in_flight` counts requests this process is forwarding to it;
    `running` and `waiting` are the engine's own counts as last scraped (0 when not).
    `origin` is where requests go (None: the URL is unusable, nothing can reach it);
    `server_name` names an engine whose URL holds a resolved address (see Origin).
    `reason` and `detail` say why it is not healthy (None while it is; health.py),
    `since` (time.time()) when that last changed; `public_url` is `url` without any
    user:password@, for logs and answers."""

    __slots__ = (
        "backoff",
        "detail",
        "ejected_until",
        "ejections",
        "failures",
        "healthy",
        "in_flight",
        "kv_cache_usage",
        "listing",
        "models_at",
        "origin",
        "public_url",
        "reason",
        "running",
        "scraped",
        "since",
        "slow_since",
        "stale",
        "url",
        "waiting",
    )

    def __init__(self, url: str, server_name: str | None = None) -> None:
        self.url = url.rstrip("/")
        try:
            self.origin: Origin | None = Origin(self.url, server_name)
        except ValueError:
            self.origin = None
        self.public_url = public_url(self.url)
        self.healthy = False
        self.reason: str | None = NOT_CHECKED.reason
        self.detail: str | None = NOT_CHECKED.detail
        self.since = time.time()
        # Why the last re-read of a healthy engine's models failed (None: it did not);
        # its last good list stays in use meanwhile.
        self.stale: Verdict | None = None
        self.in_flight = 0
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        # True once `running`, `waiting` and `kv_cache_usage` come from a scrape.
        self.scraped = False
        self.listing = ModelList()
        # When the models were last read; 0: never (the engine cannot be healthy yet).
        self.models_at = 0.0
        # Passive ejection: 5xx answers in a row, the current back-off, until when.
        self.failures = 0
        self.backoff = 0.0
        self.ejected_until = 0.0
        self.ejections = 0
        # When this run of timed-out checks began while the engine was busy (None: the
        # last check did not time out, or it was idle).
        self.slow_since: float | None = None

    @property
    def models(self) -> frozenset[str]:
        """The models (and LoRA adapters) the engine listed when last read."""
        return self.listing.ids

    @property
    def load(self) -> int:
        """What the load bound and `least_loaded` compare: the engine's own count of
        requests running and waiting, which every replica and worker reads alike, or
        this process's requests in flight when that is higher (sent since the last
        scrape) or nothing was scraped."""
        if not self.scraped:
            return self.in_flight
        return max(self.in_flight, self.running + self.waiting)

    def __repr__(self) -> str:
        return f"Engine({self.url!r}, healthy={self.healthy}, in_flight={self.in_flight})"


def public_url(url: str) -> str:
    """`url` without the user:password@ part a configured URL may carry."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


class Lease:
    """An engine held for one request: counted in its `in_flight` from entering the
    `with` block to leaving it, however the request ends, so the count cannot drift."""

    __slots__ = ("engine",)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> Engine:
        self.engine.in_flight += 1
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.in_flight -= 1


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
        self._upstream = upstream
        self._headers = list(headers)
        # Whether the engine key goes with each request (health reasons name it).
        self._keyed = any(name.lower() == b"authorization" for name, _ in self._headers)
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
        engine.failures = 0
        self._judge(engine, ejected_verdict(error, after_5xx=after, backoff=engine.backoff))
        self._changed(engine)

    def failed(self, engine: Engine) -> None:
        """The engine answered 5xx (or broke a response off): a run of them ejects it."""
        engine.failures += 1
        if engine.failures >= self._settings.eject_after_5xx:
            self.eject(engine, reason="5xx")

    @staticmethod
    def succeeded(engine: Engine) -> None:
        """The engine answered below 500: its run of failures and its back-off end."""
        engine.failures = 0
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

    # -- active checks -----------------------------------------------------------------------

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.engines))

    async def _get(self, engine: Engine, path: str) -> tuple[int, bytes]:
        """GET `path` and its whole answer within `routing.health_timeout`. Raises
        UpstreamError or TimeoutError."""
        if engine.origin is None:
            raise ConnectFailed("engine URL")
        limit = self._settings.health_timeout
        async with asyncio.timeout(limit):
            resp = await self._upstream.request(engine.origin, "GET", path, self._headers, None)
            try:
                return resp.status, await resp.read(limit)
            finally:
                resp.close()

    async def _probe(self, engine: Engine, path: str) -> tuple[int, bytes] | Verdict:
        """GET `path`: the status and body, or why there was no answer."""
        if engine.origin is None:
            return INVALID_URL
        try:
            return await self._get(engine, path)
        except (UpstreamError, TimeoutError) as exc:
            return error_verdict(exc, path, self._settings.health_timeout)

    async def _check(self, engine: Engine) -> None:
        if not engine.healthy and time.monotonic() < engine.ejected_until:
            return  # ejected: not tried again before its back-off ends
        verdict: Verdict | None = None
        answer = await self._probe(engine, HEALTH_PATH)
        if isinstance(answer, Verdict):
            verdict = answer
        elif answer[0] != 200:
            verdict = status_verdict(HEALTH_PATH, answer[0], keyed=self._keyed)
        if self._busy(engine, verdict):
            return
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
        health_changed = self._judge(engine, verdict)
        if health_changed or models_changed:
            self._changed(engine)

    def _busy(self, engine: Engine, verdict: Verdict | None) -> bool:
        """True when `verdict` is a timeout that leaves `engine` in rotation: it is
        healthy, has requests of this process in flight, and its checks have timed out
        for less than `routing.busy_grace` seconds in a row (logged once per run)."""
        if (
            verdict is None
            or verdict.reason != TIMEOUT
            or not (engine.healthy and engine.in_flight)
        ):
            engine.slow_since = None
            return False
        now = time.monotonic()
        if engine.slow_since is None:
            engine.slow_since = now
            log.info(
                "engine_health_slow",
                engine=engine.public_url,
                in_flight=engine.in_flight,
                detail=verdict.detail,
            )
        return now - engine.slow_since < self._settings.busy_grace

    def _judge(self, engine: Engine, verdict: Verdict | None) -> bool:
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

    # -- engine-reported load -------------------------------------------------------------

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(e) for e in self._healthy))

    async def _scrape(self, engine: Engine) -> None:
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


async def _round(job: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """One round of a background loop. An unexpected failure is logged, under the name
    `_spawn` gave the loop's task, and the next round runs: escaping, it would end the
    task, and the checks with it, silently."""
    try:
        await job()
    except Exception:
        task = asyncio.current_task()
        log.exception("engine_loop_failed", loop=task.get_name() if task else None)
