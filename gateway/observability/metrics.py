"""Prometheus metrics of the gateway itself, in a registry owned by one app instance."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode("latin-1")

# The `key` label of requests that presented no valid key (the open routes, refusals
# before a key was recognised). No key's name is empty (config/key_file.py's
# `build_keys` names a key without one `key-<n>`), so this label is never a key's. Other
# values are key names, as many as the keys configured (key-file reloads included).
NO_KEY = ""

# Latency buckets from 1 ms: the gateway's own answers take well under a millisecond,
# generation takes seconds.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Their `le` labels as prometheus_client writes them ("1.0", "+Inf").
_BUCKET_LABELS = (*(repr(float(b)) for b in _BUCKETS), "+Inf")


class EngineStats(Protocol):
    """What the metrics read of an engine at scrape time (the pool's engines); it is
    labelled by its URL without credentials."""

    public_url: str
    healthy: bool
    in_flight: int
    waiting: int
    kv_cache_usage: float
    scraped: bool
    ejections: int


class RoutingCounts:
    """Routing decisions, counted with plain integer adds on the request path and read
    at scrape time: a labelled prometheus counter takes a lock per increment."""

    __slots__ = ("failovers", "first", "spilled")

    def __init__(self) -> None:
        # Requests the policy sent to their anchor's first choice, or elsewhere (the
        # load bound moved them).
        self.first = 0
        self.spilled = 0
        # Times a refused connection moved a request on to the next engine.
        self.failovers = 0


class StoreStats(Protocol):
    """What the metrics read of the shared placement store (routing/store.py)."""

    @property
    def up(self) -> bool: ...

    @property
    def read(self) -> int: ...

    @property
    def placed(self) -> int: ...

    @property
    def fallback(self) -> int: ...

    @property
    def dropped(self) -> int: ...


class StoreCollector(Collector):
    """The shared placement store's counts and state, read at scrape time."""

    def __init__(self, store: StoreStats) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        store = self._store
        placements = CounterMetricFamily(
            "gateway_routing_store_placements",
            "Requests placed through the shared placement store, by outcome: the anchor's "
            "recorded engine `read`, a new placement `placed`, or `fallback` (the store "
            "failed, was slow or is being left alone after that: placed statelessly).",
            labels=["result"],
        )
        placements.add_metric(["read"], float(store.read))
        placements.add_metric(["placed"], float(store.placed))
        placements.add_metric(["fallback"], float(store.fallback))
        dropped = CounterMetricFamily(
            "gateway_routing_store_anchors_dropped",
            "Anchors deleted from the shared placement store because the key that placed "
            "them held more than routing.store_anchors_per_key (its least recently used "
            "first).",
        )
        dropped.add_metric([], float(store.dropped))
        up = GaugeMetricFamily(
            "gateway_routing_store_up",
            "1 while the shared placement store answers, 0 while requests are placed without "
            "it; the lowest over workers (0: some worker places without it).",
        )
        up.add_metric([], 1.0 if store.up else 0.0)
        yield from (placements, dropped, up)


class SharedStoreCollector(Collector):
    """The shared store's state and the admissions decided without it, at scrape time."""

    def __init__(
        self, up: Callable[[], bool], fallbacks: Callable[[], dict[tuple[str, str], int]]
    ) -> None:
        self._up = up
        self._fallbacks = fallbacks

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gateway_store_up",
            "1 when the shared store (store_url) answered its last call, 0 while it is "
            "left alone after a failure; across workers, the lowest.",
        )
        up.add_metric([], 1.0 if self._up() else 0.0)
        fallback = CounterMetricFamily(
            "gateway_limits_store_fallback",
            "Admissions of keys with shared limits decided without the store (down or "
            "slow), by limit (`rate`, `in_flight`) and action (`local`: checked per "
            "process; `refuse`: 503 limits_unavailable).",
            labels=["limit", "action"],
        )
        for (limit, action), count in list(self._fallbacks().items()):
            fallback.add_metric([limit, action], float(count))
        yield from (up, fallback)


class ConnectionCounts:
    """Client connections the gateway closed itself, by reason (gateway/server/protocol.py):
    plain integer adds on the connection path, read at scrape time."""

    __slots__ = (
        "body_chunks_too_small",
        "evicted",
        "head_timeout",
        "headers_too_large",
        "idle_timeout",
        "max_connections",
        "pipeline_full",
        "response_stall",
    )

    def __init__(self) -> None:
        # Some bytes of a request head arrived, not all of it in `timeouts.request_head`.
        self.head_timeout = 0
        # Nothing arrived in `timeouts.request_head` (a new connection, or a keep-alive
        # one when the head deadline is shorter than the keep-alive wait).
        self.idle_timeout = 0
        # Over `limits.max_connections` with every connection's request in progress:
        # closed as soon as accepted.
        self.max_connections = 0
        # Waiting longest for a head when a new connection came at the cap: closed to
        # make room for it.
        self.evicted = 0
        # A chunked body in chunks too small on average (protocol.MIN_CHUNK_BYTES):
        # 400, then closed.
        self.body_chunks_too_small = 0
        # A head over `limits.max_header_bytes`: 431, then closed.
        self.headers_too_large = 0
        # A response left unread for `timeouts.response_stall`: dropped.
        self.response_stall = 0
        # A request pipelined beyond protocol.MAX_PIPELINED: the queued ones
        # answered, then closed.
        self.pipeline_full = 0


class TokenCounts(Collector):
    """Tokens the engines reported in their answers (gateway/proxy/usage.py), by key name:
    plain integer adds per answer, read at scrape time (a labelled prometheus counter
    takes a lock per increment)."""

    def __init__(self) -> None:
        # Key name -> [prompt tokens, completion tokens].
        self.by_key: dict[str, list[int]] = {}

    def add(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        counts = self.by_key.get(key)
        if counts is None:
            counts = self.by_key[key] = [0, 0]
        counts[0] += prompt_tokens
        counts[1] += completion_tokens

    def collect(self) -> Iterator[Metric]:
        prompt = CounterMetricFamily(
            "gateway_prompt_tokens",
            "Prompt tokens of the answers whose engine reported `usage`, by key name.",
            labels=["key"],
        )
        completion = CounterMetricFamily(
            "gateway_completion_tokens",
            "Completion tokens of the answers whose engine reported `usage`, by key name.",
            labels=["key"],
        )
        for key, (prompt_tokens, completion_tokens) in self.by_key.items():
            prompt.add_metric([key], float(prompt_tokens))
            completion.add_metric([key], float(completion_tokens))
        yield from (prompt, completion)


class AudioSeconds(Collector):
    """Seconds of audio of the transcriptions and translations answered, by key name
    (proxy/metering.py: `Metering.audio_seconds`); plain float adds per answer, read at
    scrape time."""

    def __init__(self) -> None:
        self.by_key: dict[str, float] = {}

    def add(self, key: str, seconds: float) -> None:
        self.by_key[key] = self.by_key.get(key, 0.0) + seconds

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gateway_audio_seconds",
            "Seconds of audio of the transcriptions and translations answered, by key name.",
            labels=["key"],
        )
        for key, seconds in self.by_key.items():
            family.add_metric([key], seconds)
        yield family


class RequestCounts(Collector):
    """Requests answered, by key name, route group, status and error code: plain
    integer adds per request, read at scrape time (a labelled prometheus counter takes a
    lock per increment, and its child is looked up per label tuple)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str | None, str, int, str], int] = {}

    def add(self, key: str | None, group: str, status: int, code: str) -> None:
        labels = (key, group, status, code)
        counts = self.counts
        counts[labels] = counts.get(labels, 0) + 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gateway_requests",
            "Requests answered, by key name (empty: no valid key), route group, HTTP "
            "status and error code.",
            labels=["key", "group", "status", "code"],
        )
        for (key, group, status, code), count in list(self.counts.items()):
            family.add_metric([key or NO_KEY, group, str(status), code], float(count))
        yield family


class GroupHistogram(Collector):
    """A latency histogram by route group with the `_BUCKETS` bounds: per observation a
    bisect and two adds, no lock (prometheus_client's Histogram takes one per bucket
    and one for the sum: ~2 us an observation, two per request). Buckets are cumulated
    at scrape time."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        # Group -> count per bucket (the last: over every bound, +Inf), and the sum.
        self.by_group: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, group: str, value: float) -> None:
        counts = self.by_group.get(group)
        if counts is None:
            counts = self.by_group[group] = [0] * (len(_BUCKETS) + 1)
            self.sums[group] = 0.0
        # A value equal to a bound falls in that bound's bucket (`le`).
        counts[bisect_left(_BUCKETS, value)] += 1
        self.sums[group] += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["group"])
        for group, counts in list(self.by_group.items()):
            buckets: list[tuple[str, float]] = []
            total = 0
            for label, count in zip(_BUCKET_LABELS, counts, strict=True):
                total += count
                buckets.append((label, float(total)))
            family.add_metric([group], buckets, self.sums[group])
        yield family


class ConnectionCollector(Collector):
    """Open client connections and the closing counts, at scrape time."""

    def __init__(self, counts: ConnectionCounts, open_connections: Callable[[], int]) -> None:
        self._counts = counts
        self._open = open_connections

    def collect(self) -> Iterator[Metric]:
        open_now = GaugeMetricFamily(
            "gateway_client_connections", "Client connections open, summed over workers."
        )
        open_now.add_metric([], float(self._open()))
        closed = CounterMetricFamily(
            "gateway_client_connections_closed",
            "Client connections the gateway closed itself, by reason: head_timeout, "
            "idle_timeout, max_connections, evicted, headers_too_large, response_stall, "
            "pipeline_full, body_chunks_too_small.",
            labels=["reason"],
        )
        for reason in ConnectionCounts.__slots__:
            closed.add_metric([reason], float(getattr(self._counts, reason)))
        yield from (open_now, closed)


# The per-engine families: kind, name, help, and an engine's value (None: not reported,
# as the queue and the cache of an engine whose metrics were never scraped).
_PER_ENGINE: tuple[
    tuple[
        type[GaugeMetricFamily | CounterMetricFamily],
        str,
        str,
        Callable[[EngineStats], float | None],
    ],
    ...,
] = (
    (
        GaugeMetricFamily,
        "gateway_engine_healthy",
        "1 when the engine is in rotation (passed its last health check, not ejected); "
        "the lowest over workers (each checks it on its own).",
        lambda e: 1.0 if e.healthy else 0.0,
    ),
    (
        GaugeMetricFamily,
        "gateway_engine_in_flight",
        "Requests this gateway is forwarding to the engine, summed over workers.",
        lambda e: float(e.in_flight),
    ),
    (
        GaugeMetricFamily,
        "gateway_engine_waiting",
        "Requests queued in the engine, from its own metrics as last scraped; the highest "
        "over workers (each scrapes it on its own).",
        lambda e: float(e.waiting) if e.scraped else None,
    ),
    (
        GaugeMetricFamily,
        "gateway_engine_kv_cache_usage",
        "The engine's KV cache usage (0-1), from its own metrics as last scraped; the "
        "highest over workers (each scrapes it on its own).",
        lambda e: e.kv_cache_usage if e.scraped else None,
    ),
    (
        CounterMetricFamily,
        "gateway_engine_ejections",
        "Times the engine was taken out of rotation by a refused connection or 5xx run.",
        lambda e: float(e.ejections),
    ),
)


class PoolCollector(Collector):
    """Per-engine gauges and the routing counts, built from live state at scrape time:
    nothing per request, and engines that leave the pool (DNS) leave the metrics."""

    def __init__(
        self, engines: Callable[[], Sequence[EngineStats]], policy: str, counts: RoutingCounts
    ) -> None:
        self._engines = engines
        self._policy = policy
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        engines = self._engines()
        for kind, name, documentation, value in _PER_ENGINE:
            family = kind(name, documentation, labels=["engine"])
            for e in engines:
                v = value(e)
                if v is not None:
                    family.add_metric([e.public_url], v)
            yield family
        decisions = CounterMetricFamily(
            "gateway_routing_decisions",
            "Requests placed by the routing policy, by whether they went to the first "
            "choice of their anchor or spilled to another engine.",
            labels=["policy", "choice"],
        )
        decisions.add_metric([self._policy, "first"], float(self._counts.first))
        decisions.add_metric([self._policy, "spilled"], float(self._counts.spilled))
        failovers = CounterMetricFamily(
            "gateway_routing_failovers",
            "Times a refused connection moved a request on to the next engine in its order.",
        )
        failovers.add_metric([], float(self._counts.failovers))
        yield from (decisions, failovers)


class Metrics:
    """The gateway's metrics. Label children are cached: `.labels()` costs microseconds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = RequestCounts()
        self.registry.register(self.requests)
        self.rejections = Counter(
            "gateway_rejections",
            "Requests the gateway refused itself, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.duration = GroupHistogram(
            "gateway_request_duration_seconds",
            "Time from request start to the last byte of the answer.",
        )
        self.registry.register(self.duration)
        self.upstream_ttfb = GroupHistogram(
            "gateway_upstream_ttfb_seconds",
            "Time from forwarding a request to the engine's response headers.",
        )
        self.registry.register(self.upstream_ttfb)
        self.in_flight = Gauge(
            "gateway_requests_in_flight",
            "Requests whose body is in, being inspected or forwarded to engines, summed over "
            "workers.",
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "gateway_rate_limited",
            "Requests refused with 429 rate_limited, by the limit they hit: `in_flight` "
            "(the key's cap on requests in flight) or `rate` (its token bucket).",
            ["reason"],
            registry=self.registry,
        )
        # Counted on failures only (access/throttle.py): a lock per increment is no cost.
        self.auth_failures = Counter(
            "gateway_auth_failures",
            "Failed authentications (a wrong key, or none where one is needed), by what "
            "came of them: `counted` (answered 401) or `throttled` (429 too_many_failures: "
            "the client address is past limits.auth_failures in the window).",
            ["result"],
            registry=self.registry,
        )
        self.tokens = TokenCounts()
        self.registry.register(self.tokens)
        self.audio = AudioSeconds()
        self.registry.register(self.audio)
        self.routing = RoutingCounts()
        self.connections = ConnectionCounts()

    def observe_request(
        self,
        group: str,
        status: int,
        code: str,
        duration: float,
        rejected: bool,
        key: str | None,
    ) -> None:
        """One answered request; `key` is the name of the key it presented (None: no
        valid key)."""
        self.requests.add(key, group, status, code)
        self.duration.observe(group, duration)
        if rejected:
            self.rejections.labels(code).inc()

    def observe_usage(self, key: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """The tokens an engine's answer reported, for the key that asked."""
        self.tokens.add(key or NO_KEY, prompt_tokens, completion_tokens)

    def observe_audio(self, key: str | None, seconds: float) -> None:
        """The seconds of audio an engine's answer reported, for the key that asked."""
        self.audio.add(key or NO_KEY, seconds)

    def observe_ttfb(self, group: str, seconds: float) -> None:
        self.upstream_ttfb.observe(group, seconds)

    def count_in_flight(self, current: Callable[[], float]) -> None:
        """Read the in-flight gauge from `current` at scrape time: no locked update
        twice per request."""
        self.in_flight.set_function(current)

    def watch_decodes(self, in_use: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Report the image decode budget (gateway/media/decoder.py) at scrape time."""
        Gauge(
            "gateway_media_decode_bytes",
            "Bytes of media.decode_budget_bytes held by image decodes in progress, summed "
            "over workers (each worker has its own budget).",
            registry=self.registry,
        ).set_function(in_use)
        Gauge(
            "gateway_media_decodes_waiting",
            "Image decodes waiting for their share of the decode budget, summed over workers.",
            registry=self.registry,
        ).set_function(waiting)

    def watch_pool(self, engines: Callable[[], Sequence[EngineStats]], policy: str) -> None:
        """Report the engines returned by `engines` and the routing counts at scrape time."""
        self.registry.register(PoolCollector(engines, policy, self.routing))

    def watch_store(self, store: StoreStats) -> None:
        """Report the shared placement store's counts and state at scrape time."""
        self.registry.register(StoreCollector(store))

    def watch_shared_store(
        self, up: Callable[[], bool], fallbacks: Callable[[], dict[tuple[str, str], int]]
    ) -> None:
        """Report the shared store's state (`up`) and the limits' fallback counts at
        scrape time."""
        self.registry.register(SharedStoreCollector(up, fallbacks))

    def watch_connections(self, open_connections: Callable[[], int]) -> None:
        """Report the open client connections (`open_connections`) and the closing
        counts at scrape time."""
        self.registry.register(ConnectionCollector(self.connections, open_connections))

    def render(self) -> bytes:
        return generate_latest(self.registry)
