"""`python -m bench.suites.metrics_files`: what the workers' shared metrics cost
(gateway/observability/multiprocess.py).

1. One increment, and one request's metrics (a count, two latencies, two token counts):
   the gateway's plain adds, prometheus_client's metrics, and the same in
   prometheus_client's multiprocess mode, which writes its mmap file on every increment
   (the mode the gateway does not use per request).
2. One copy of a busy worker's registry into its files (`--keys` keys, each with requests
   in four route groups at four statuses, tokens, two latency histograms, eight engines):
   the first (the keys and files made), one with nothing changed, one with every value
   changed. A worker copies once a second: the copy's time is its share of a second.
3. One merge of 2, 4 and 8 workers' files: what a scrape adds, in its thread.
4. With servers (not `--no-servers`): /metrics of a gateway with 1 and with 2 workers
   before a simulated engine, scraped in turns on new connections after 200 requests.

    python -m bench.suites.metrics_files             # ~1 minute
    python -m bench.suites.metrics_files --keys 1000 --no-servers
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, values

from bench.suites.fleet import BENCH_KEY, CpuPlan, Fleet
from bench.suites.report import progress
from gateway.observability.metrics import _BUCKETS, Metrics
from gateway.observability.multiprocess import MetricFiles

GROUPS = ("inference", "pooling", "models", "metrics")
STATUSES = ((200, ""), (400, "invalid_request"), (429, "rate_limited"), (502, "upstream_error"))


class _Engine:
    def __init__(self, index: int) -> None:
        self.public_url = f"http://10.0.0.{index}:8000"
        self.healthy = True
        self.in_flight = index
        self.waiting = 2 * index
        self.kv_cache_usage = 0.1 * index
        self.scraped = True
        self.ejections = 0


def per_call(fn: Callable[[], object], number: int = 200_000, repeat: int = 5) -> float:
    """Microseconds per call of `fn`: the least of `repeat` runs."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


class _PerRequest:
    """What one request records, with prometheus_client's own metrics: its count, two
    latencies and two token counts (the gateway's Metrics: observe_request, observe_ttfb,
    observe_usage)."""

    def __init__(self) -> None:
        registry = CollectorRegistry()
        labels = ["key", "group", "status", "code"]
        self.requests = Counter("r", "r", labels, registry=registry)
        self.duration = Histogram("d", "d", ["group"], buckets=_BUCKETS, registry=registry)
        self.ttfb = Histogram("t", "t", ["group"], buckets=_BUCKETS, registry=registry)
        self.prompt = Counter("p", "p", ["key"], registry=registry)
        self.completion = Counter("c", "c", ["key"], registry=registry)

    def __call__(self) -> None:
        self.requests.labels("alice", "inference", "200", "").inc()
        self.duration.labels("inference").observe(0.012)
        self.ttfb.labels("inference").observe(0.004)
        self.prompt.labels("alice").inc(100)
        self.completion.labels("alice").inc(20)


def _gateway_request(metrics: Metrics) -> Callable[[], None]:
    def record() -> None:
        metrics.observe_request("inference", 200, "", 0.012, False, "alice")
        metrics.observe_ttfb("inference", 0.004)
        metrics.observe_usage("alice", 100, 20)

    return record


def increments(directory: Path) -> dict[str, float]:
    """Microseconds of one increment and of one request's metrics, each way."""
    plain = Metrics()
    ordinary = Counter("c", "c", ["key"], registry=CollectorRegistry()).labels("alice")
    ordinary_request = _PerRequest()
    # prometheus_client chooses its value class when a metric is made: its multiprocess
    # one, writing under `directory`, for these.
    saved, env = values.ValueClass, os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.MultiProcessValue()
    try:
        mmaped = Counter("m", "m", ["key"], registry=CollectorRegistry()).labels("alice")
        mmaped_request = _PerRequest()
        # Label children are made on first use, with the value class of that moment.
        mmaped_request()
    finally:
        values.ValueClass = saved
        if env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR")
    return {
        "increment: gateway adds (RequestCounts.add)": per_call(
            lambda: plain.requests.add("alice", "inference", 200, "")
        ),
        "increment: prometheus_client Counter": per_call(ordinary.inc),
        "increment: prometheus_client Counter, multiprocess mode": per_call(mmaped.inc),
        "request: gateway Metrics": per_call(_gateway_request(plain), 50_000),
        "request: prometheus_client metrics": per_call(ordinary_request, 50_000),
        "request: prometheus_client metrics, multiprocess mode": per_call(mmaped_request, 50_000),
    }


def busy(keys: int) -> Metrics:
    """A worker's registry after traffic from `keys` keys."""
    metrics = Metrics()
    engines = [_Engine(i) for i in range(8)]
    metrics.watch_pool(lambda: engines, "affinity")
    metrics.watch_connections(lambda: 17)
    metrics.count_in_flight(lambda: 5.0)
    traffic(metrics, keys)
    return metrics


def traffic(metrics: Metrics, keys: int) -> None:
    for k in range(keys):
        key = f"key-{k}"
        for g, group in enumerate(GROUPS):
            for status, code in STATUSES:
                metrics.observe_request(group, status, code, 0.001 * (k + g), bool(code), key)
                metrics.observe_ttfb(group, 0.0005 * (k + g))
        metrics.observe_usage(key, 100, 20)


def series(metrics: Metrics) -> int:
    return sum(len(f.samples) for f in metrics.registry.collect())


def copies(keys: int, directory: Path) -> dict[str, float]:
    metrics = busy(keys)
    files = MetricFiles(metrics.registry, directory, pid=1, alive=lambda pid: True)
    t0 = time.perf_counter()
    files.copy()
    first = time.perf_counter() - t0
    unchanged = min(timeit.repeat(files.copy, number=1, repeat=20))
    changed = []
    for _ in range(20):
        traffic(metrics, keys)
        t0 = time.perf_counter()
        files.copy()
        changed.append(time.perf_counter() - t0)
    files.close()
    return {
        "series": series(metrics),
        "first copy (ms)": first * 1e3,
        "copy, nothing changed (ms)": unchanged * 1e3,
        "copy, every value changed (ms)": min(changed) * 1e3,
    }


def merges(keys: int, directory: Path, workers: Sequence[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for n in workers:
        folder = directory / f"merge-{n}"
        folder.mkdir()
        opened = [
            MetricFiles(busy(keys).registry, folder, pid=100 + i, alive=lambda pid: True)
            for i in range(n)
        ]
        for f in opened:
            f.copy()
        out[n] = min(timeit.repeat(opened[0].merge, number=1, repeat=10)) * 1e3
        for f in opened:
            f.close()
    return out


def scrapes(workdir: Path, rounds: int) -> dict[str, tuple[float, float, int]]:
    """Median and p90 milliseconds of a scrape, and its bytes, per gateway."""
    with Fleet(workdir, CpuPlan(None, None)) as fleet:
        sim = fleet.sim("--latency", "zero")
        env = {"GATEWAY_PUBLIC_METRICS": "true"}
        gateways = {
            f"{n} worker{'s' * (n > 1)}": fleet.gateway([sim.url], env, workers=n, pin=False)
            for n in (1, 2)
        }
        time.sleep(5)  # the second worker's start
        body = {"model": "Qwen/Qwen3-VL-2B-Instruct", "prompt": "x", "max_tokens": 1}
        headers = {"Authorization": f"Bearer {BENCH_KEY}", "Connection": "close"}
        client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=10)
        for server in gateways.values():
            for _ in range(200):
                client.post(server.url + "/v1/completions", json=body, headers=headers)
        time.sleep(1.5)
        times: dict[str, list[float]] = {name: [] for name in gateways}
        size: dict[str, int] = {}
        for _ in range(rounds):
            for name, server in gateways.items():
                t0 = time.perf_counter()
                r = client.get(server.url + "/metrics")
                times[name].append(time.perf_counter() - t0)
                size[name] = len(r.content)
        client.close()
    return {
        name: (
            statistics.median(t) * 1e3,
            statistics.quantiles(t, n=10)[-1] * 1e3,
            size[name],
        )
        for name, t in times.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100, help="keys with traffic (default 100)")
    parser.add_argument("--rounds", type=int, default=200, help="scrapes per gateway")
    parser.add_argument("--no-servers", action="store_true", help="skip the real scrapes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-metrics-files-") as tmp:
        directory = Path(tmp)
        progress("increments")
        inc = increments(directory)
        progress(f"copies, {args.keys} keys")
        copy = copies(args.keys, directory)
        progress("merges")
        merged = merges(args.keys, directory, (2, 4, 8))
        served = {} if args.no_servers else scrapes(directory, args.rounds)
    print("\n| metrics recorded | us |\n|---|---|")
    for name, us in inc.items():
        print(f"| {name} | {us:.2f} |")
    print(f"\n| one worker's copy ({args.keys} keys) | value |\n|---|---|")
    for name, v in copy.items():
        print(f"| {name} | {v:.2f} |" if isinstance(v, float) else f"| {name} | {v} |")
    print(f"\n| merge of the workers' files ({copy['series']} series each) | ms |\n|---|---|")
    for n, ms in merged.items():
        print(f"| {n} workers | {ms:.2f} |")
    if served:
        print("\n| /metrics over loopback | median ms | p90 ms | bytes |\n|---|---|---|---|")
        for name, (median, p90, size) in served.items():
            print(f"| {name} | {median:.2f} | {p90:.2f} | {size} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
