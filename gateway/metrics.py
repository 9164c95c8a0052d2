"""Prometheus metrics of the gateway itself, in a registry owned by one app instance."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode("latin-1")

# Latency buckets from 1 ms: the gateway's own answers take well under a millisecond,
# generation takes seconds.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """The gateway's metrics. Label children are cached: `.labels()` costs microseconds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by route group, HTTP status and error code.",
            ["group", "status", "code"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "gateway_rejections",
            "Requests the gateway refused itself, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from request start to the last byte of the answer.",
            ["group"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.upstream_ttfb = Histogram(
            "gateway_upstream_ttfb_seconds",
            "Time from forwarding a request to the engine's response headers.",
            ["group"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "gateway_requests_in_flight",
            "Requests being forwarded to engines.",
            registry=self.registry,
        )
        self.engine_healthy = Gauge(
            "gateway_engine_healthy",
            "1 when the engine passed its last health check.",
            ["engine"],
            registry=self.registry,
        )
        self._requests: dict[tuple[str, int, str], Counter] = {}
        self._durations: dict[str, Histogram] = {}
        self._ttfbs: dict[str, Histogram] = {}

    def observe_request(
        self, group: str, status: int, code: str, duration: float, rejected: bool
    ) -> None:
        key = (group, status, code)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(group, str(status), code)
        child.inc()
        hist = self._durations.get(group)
        if hist is None:
            hist = self._durations[group] = self.duration.labels(group)
        hist.observe(duration)
        if rejected:
            self.rejections.labels(code).inc()

    def observe_ttfb(self, group: str, seconds: float) -> None:
        hist = self._ttfbs.get(group)
        if hist is None:
            hist = self._ttfbs[group] = self.upstream_ttfb.labels(group)
        hist.observe(seconds)

    def count_in_flight(self, current: Callable[[], float]) -> None:
        """Read the in-flight gauge from `current` at scrape time: no locked update
        twice per request."""
        self.in_flight.set_function(current)

    def set_engine_health(self, engine: str, healthy: bool) -> None:
        self.engine_healthy.labels(engine).set(1 if healthy else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
