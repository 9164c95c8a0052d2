"""The lock-free request counts and latency histograms (observability/metrics.py) expose what
prometheus_client's own Counter and Histogram would for the same observations."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import _BUCKETS, NO_KEY, Metrics


def samples(text: bytes, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name.startswith(prefix) and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_same_exposition_as_prometheus_client() -> None:
    rng = random.Random(5)
    # Every bound exactly (a value on a bound belongs to its bucket), around them, far out.
    values = [*_BUCKETS, *(b * 1.0001 for b in _BUCKETS), 0.0, 1e-6, 1e4]
    values += [rng.expovariate(20) for _ in range(500)]
    reference = CollectorRegistry()
    duration = Histogram(
        "gateway_request_duration_seconds", "d", ["group"], buckets=_BUCKETS, registry=reference
    )
    ttfb = Histogram(
        "gateway_upstream_ttfb_seconds", "t", ["group"], buckets=_BUCKETS, registry=reference
    )
    requests = Counter(
        "gateway_requests", "r", ["key", "group", "status", "code"], registry=reference
    )
    metrics = Metrics()
    for i, v in enumerate(values):
        group = ("inference", "local", "metrics")[i % 3]
        key = (None, "alice", "bob")[i % 2]
        status, code = ((200, ""), (429, "rate_limited"))[i % 5 == 0]
        metrics.observe_request(group, status, code, v, False, key)
        metrics.observe_ttfb(group, v / 2)
        duration.labels(group).observe(v)
        ttfb.labels(group).observe(v / 2)
        requests.labels(key or NO_KEY, group, str(status), code).inc()
    ours, theirs = metrics.render(), generate_latest(reference)
    for prefix in ("gateway_request_duration", "gateway_upstream_ttfb", "gateway_requests_total"):
        mine = samples(ours, prefix)
        assert mine and mine.keys() == samples(theirs, prefix).keys()
        for name, value in samples(theirs, prefix).items():
            assert abs(mine[name] - value) < 1e-9, name
