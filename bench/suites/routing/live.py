"""One live run: fresh engines and a front end per workload, the engines' counters
before and after, and what they say (hit rate, uncached tokens, balance, TTFT)."""

from __future__ import annotations

import asyncio
import statistics
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.harness.metrics import scrape, total
from bench.harness.server import Server
from bench.suites.fleet import CpuPlan, Fleet
from bench.suites.report import fmt, progress
from bench.suites.routing.client import replay
from bench.suites.routing.fronts import Front
from bench.suites.routing.options import INFERENCE_PATHS, MODEL, Options
from bench.suites.routing.workloads import Workload

# --- engine counters -------------------------------------------------------------------


@dataclass
class Counters:
    queries: float = 0.0
    hits: float = 0.0
    requests: float = 0.0


def counters(engine: str) -> Counters:
    """The engine's prefix-cache counters and the inference requests it received."""
    samples = scrape(engine + "/metrics", timeout=10)
    return Counters(
        queries=total(samples, "vllm:prefix_cache_queries_total"),
        hits=total(samples, "vllm:prefix_cache_hits_total"),
        requests=sum(
            total(samples, "sim:received_requests_total", path=path) for path in INFERENCE_PATHS
        ),
    )


@dataclass
class Result:
    front: str
    workload: str
    hit_rate: float
    uncached: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    max_over_mean: float | None
    # Max / mean of the engines' time-averaged requests in flight.
    busy_max_over_mean: float | None
    per_engine: list[float]
    errors: int
    seconds: float
    # Hit rate over the warm-up sessions (None without a warm-up).
    warm_hit_rate: float | None = None
    # Max / mean requests per engine over the warm-up and the measured part together.
    whole_max_over_mean: float | None = None
    # Follow-up agreement (bench/README.md): of the measured calls whose key (a
    # conversation, an image) was sent before, the fraction that reached the engine the
    # key's previous call reached; `agreement` counts the keys begun in the measured
    # part, `agreement_all` also those begun in the warm-up. None: no such calls, or
    # the front end does not pass X-Request-Id on.
    agreement: float | None = None
    agreement_all: float | None = None
    follow_ups: int = 0


def _delta(before: list[Counters], after: list[Counters]) -> tuple[float, float]:
    """Prefix-cache queries and hits, summed over the engines, between two scrapes."""
    queries = sum(a.queries - b.queries for a, b in zip(after, before, strict=True))
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    return queries, hits


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1000


def run_front(
    front: Front, workloads: list[Workload], opts: Options, workdir: Path, cpus: CpuPlan
) -> list[Result]:
    """Each workload on fresh engines and a fresh front end: no cache, hot window or
    count carries over, so every row measures that workload alone."""
    return [run_one(front, w, opts, workdir, cpus) for w in workloads]


def run_one(
    front: Front, workload: Workload, opts: Options, workdir: Path, cpus: CpuPlan
) -> Result:
    with Fleet(workdir, cpus) as fleet, ExitStack() as stack:
        if front.ideal:
            cache = str(opts.kv_cache_tokens * opts.engines)
            sims = [fleet.sim("--kv-cache-tokens", cache, "--latency", "zero", name="sim-ideal")]
        else:
            sims = _start_sims(fleet, opts)
        engines = [s.url for s in sims]
        headers: dict[str, str] = {}
        if front.start is None:
            urls = engines
        else:
            urls, headers = front.start(fleet, engines, stack)
        for url in urls:
            _wait_for_model(url, headers)
        start = [counters(e) for e in engines]
        warm = workload.sessions[: workload.warmup]
        warm_outcome = asyncio.run(
            replay(warm, urls, headers, opts.concurrency, opts.live, tag="w")
        )
        before = [counters(e) for e in engines]
        t0 = time.monotonic()
        outcome = asyncio.run(
            replay(workload.measured, urls, headers, opts.concurrency, opts.live, engines, "m")
        )
        seconds = time.monotonic() - t0
        after = [counters(e) for e in engines]
        where = {} if front.ideal else served(engines)
    queries, hits = _delta(start, before)
    warm_hit_rate = hits / queries if queries else None
    queries, hits = _delta(before, after)
    per_engine = [a.requests - b.requests for a, b in zip(after, before, strict=True)]
    mean = statistics.mean(per_engine)
    result = Result(
        front=front.name,
        workload=workload.name,
        hit_rate=hits / queries if queries else 0.0,
        uncached=queries - hits,
        ttft_p50_ms=None if front.ideal else _pct(outcome.ttft, 50),
        ttft_p99_ms=None if front.ideal else _pct(outcome.ttft, 99),
        max_over_mean=None if front.ideal or not mean else max(per_engine) / mean,
        busy_max_over_mean=_max_over_mean(outcome.busy) if not front.ideal else None,
        per_engine=per_engine,
        errors=outcome.errors + warm_outcome.errors,
        seconds=seconds,
        warm_hit_rate=warm_hit_rate,
        whole_max_over_mean=None
        if front.ideal
        else _max_over_mean([a.requests - b.requests for a, b in zip(after, start, strict=True)]),
    )
    if not front.ideal:
        result.agreement, result.agreement_all, result.follow_ups = agreement(
            warm_outcome.calls, outcome.calls, where
        )
    outcome.first_error = outcome.first_error or warm_outcome.first_error
    if result.errors:
        progress(f"  {result.errors} errors, first: {outcome.first_error}")
    agree = "" if result.agreement is None else f", follow-ups {result.agreement:.1%}"
    progress(
        f"  {front.name} / {workload.name}: hit {result.hit_rate:.1%}{agree}, "
        f"p50 {fmt(result.ttft_p50_ms)} ms, load {per_engine}, {seconds:.1f}s"
    )
    return result


def merged_rows(folder: Path, results: list[Result], workloads: list[Workload]) -> list[Result]:
    """The rows of an earlier run (`folder`/results.json) for the workloads run now and
    the front ends not run now, in the earlier run's order."""
    raw = orjson.loads((folder / "results.json").read_bytes())
    ran = {r.front for r in results}
    names = {w.name for w in workloads}
    return [
        Result(**row)
        for row in raw["raw"]["results"]
        if row["front"] not in ran and row["workload"] in names
    ]


def served(engines: Sequence[str]) -> dict[str, int]:
    """X-Request-Id a client sent -> index of the engine that received it, from the
    engines' request recorders (a gateway appends `-` and 16 hex digits to the id)."""
    out: dict[str, int] = {}
    for index, engine in enumerate(engines):
        with urllib.request.urlopen(engine + "/sim/requests", timeout=30) as resp:  # noqa: S310
            entries = orjson.loads(resp.read())
        for entry in entries:
            request_id = entry["headers"].get("x-request-id")
            if entry["path"] in INFERENCE_PATHS and request_id:
                client, sep, suffix = request_id.rpartition("-")
                out[client if sep and len(suffix) == 16 else request_id] = index
    return out


def agreement(
    warm: list[tuple[str, str | None]],
    measured: list[tuple[str, str | None]],
    where: dict[str, int],
) -> tuple[float | None, float | None, int]:
    """Follow-up agreement over the measured calls: (keys begun in the measured part,
    all keys, follow-ups counted in the first figure). None without follow-ups, or
    when the engines did not see the calls' ids."""
    last: dict[str, int] = {}
    begun_before: set[str] = set()
    same = total_ = same_all = total_all = 0
    for part, calls in (("warm", warm), ("measured", measured)):
        for request_id, key in calls:
            engine = where.get(request_id)
            if key is None or engine is None:
                continue
            if part == "measured" and key in last:
                total_all += 1
                same_all += last[key] == engine
                if key not in begun_before:
                    total_ += 1
                    same += last[key] == engine
            if part == "warm":
                begun_before.add(key)
            last[key] = engine
    return (
        same / total_ if total_ else None,
        same_all / total_all if total_all else None,
        total_,
    )


def _wait_for_model(
    url: str, headers: dict[str, str], timeout: float = 30.0, model: str = MODEL
) -> None:
    """Wait until the front end lists the model: a gateway learns the engines' models
    from their /v1/models, and refuses the model (403) until it has."""
    req = urllib.request.Request(url + "/v1/models", headers=headers)  # noqa: S310 (loopback)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 (loopback)
                if model in resp.read().decode():
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} does not list {model} after {timeout}s")


def _max_over_mean(values: Sequence[float]) -> float | None:
    mean = statistics.mean(values) if values else 0.0
    return max(values) / mean if mean else None


def _start_sims(fleet: Fleet, opts: Options) -> list[Server]:
    args: tuple[str, ...] = ("--kv-cache-tokens", str(opts.kv_cache_tokens))
    args += ("--latency", "calibrated")
    # The recorder tells where each call went (`served`); it also keeps the load polls.
    args += ("--record-requests", "50000")
    # In parallel: each start waits for /health, and there are 4 x 7 x 4 of them a run.
    with ThreadPoolExecutor(opts.engines) as pool:
        futures = [pool.submit(fleet.sim, *args, name=f"sim-{i}") for i in range(opts.engines)]
        return [f.result() for f in futures]
