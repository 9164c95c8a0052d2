"""The report of a routing run on real engines: the summary table, a table per workload,
issue 31's goals graded, and the plots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from bench.suites.report import Report, fmt
from bench.suites.routing.real import (
    AFFINITY,
    CACHE_AWARE,
    FRONTS,
    IDEAL,
    LEAST_LOADED,
    ROUND_ROBIN,
    ROUTER_RR,
    STORE,
    RealResult,
    p99_gap_interval,
)
from bench.suites.routing.real_workloads import EVICTION, NAMES

# Issue 31's bounds: the tail against the best peer, the balance of uncached work, and
# the hit rate against the ideal engine's when caches evict.
TAIL_WORKLOADS = ("chat", "images")
BALANCE = 1.25
EVICTION_SHARE = 0.9
PEERS = (ROUND_ROBIN, LEAST_LOADED, CACHE_AWARE, ROUTER_RR)


def _by(results: list[RealResult], front: str, workload: str) -> RealResult | None:
    return next((r for r in results if r.front == front and r.workload == workload), None)


def _workloads(results: list[RealResult]) -> list[str]:
    ran = {r.workload for r in results}
    return [w for w in NAMES if w in ran]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def write_real_report(report: Report, results: list[RealResult]) -> None:
    workloads = _workloads(results)
    # The ideal first, as the column the others are read against; then FRONTS' order.
    summary_fronts = [IDEAL, *(f for f in FRONTS if f != IDEAL)]
    shown = [f for f in summary_fronts if any(r.front == f for r in results)]
    rows = []
    for w in workloads:
        cells: list[Any] = [w]
        for front in shown:
            r = _by(results, front, w)
            cells.append("" if r is None else f"{r.hit_rate:.3f}")
        rows.append(cells)
    report.table("Hit rate by workload and front end", ["workload", *shown], rows)
    for w in workloads:
        rows = []
        for front in FRONTS:
            r = _by(results, front, w)
            if r is None:
                continue
            rows.append(
                [
                    r.front,
                    f"{r.hit_rate:.3f}",
                    f"{r.uncached:,.0f}",
                    fmt(r.uncached_max_over_mean, 2),
                    fmt(r.requests_max_over_mean, 2),
                    fmt(r.ttft_p50_ms, 0),
                    fmt(r.ttft_p99_ms, 0),
                    " / ".join(f"{p:,.0f}" for p in r.run_p99_ms) if r.runs > 1 else "",
                    _pct(r.agreement),
                    r.calls,
                    r.errors,
                    "n/a" if r.cold_cached is None else r.cold_cached,
                    "n/a" if r.nothing_cached is None else r.nothing_cached,
                    f"{r.seconds:.0f}",
                ]
            )
        report.table(
            f"{w}",
            [
                "front end",
                "hit rate",
                "uncached tokens",
                "max/mean uncached",
                "max/mean requests",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TTFT p99 of each run, ms",
                "follow-ups on their engine",
                "requests",
                "errors",
                "cold calls' cached tokens",
                "calls with nothing cached",
                "seconds",
            ],
            rows,
        )
    slowest(report, results)
    grade(report, results)
    report.raw["results"] = [asdict(r) for r in results]
    if results:
        plot_real(report, results)


def slowest(report: Report, results: list[RealResult]) -> None:
    """Per workload, each front end's slowest calls to a first chunk: which call (its key
    and turn: turn 0 is the key's first call), how much of its prompt the engine had
    cached, which engine served it, how many other calls that engine had at some
    moment before the first chunk, and in which run of its front end. What the TTFT p99
    is made of."""
    for w in _workloads(results):
        rows = []
        for front in FRONTS:
            r = _by(results, front, w)
            for c in [] if r is None else r.slowest:
                rows.append(
                    [
                        front,
                        f"{c.ttft_ms:,.0f}",
                        c.key or "",
                        c.turn,
                        c.index,
                        "n/a" if c.cached is None else f"{c.cached:,}",
                        "n/a" if c.engine is None else c.engine,
                        "n/a" if c.alongside is None else c.alongside,
                        "n/a" if c.beside is None else c.beside,
                        c.run + 1,
                    ]
                )
        if rows:
            report.table(
                f"{w}: the slowest calls",
                ["front end", "TTFT ms", "key", "its call", "call of the run", "cached tokens",
                 "engine", "other calls on its engine", "of them running there when sent",
                 "run"],
                rows,
            )  # fmt: skip


def grade(report: Report, results: list[RealResult]) -> None:
    """Issue 31's goals for `affinity` as it runs without shared state, and with the
    shared placement store, on the workloads that ran."""
    for front in (AFFINITY, STORE):
        _grade(report, results, front)


def _grade(report: Report, results: list[RealResult], front: str) -> None:
    after = " after a warm-up" if report.meta.get("warm_up") else ""
    for w in TAIL_WORKLOADS:
        aff = _by(results, front, w)
        peers = [
            r for f in PEERS if (r := _by(results, f, w)) is not None and r.ttft_p99_ms is not None
        ]
        if aff is None or aff.ttft_p99_ms is None or not peers:
            continue
        best = min(peers, key=lambda r: r.ttft_p99_ms or 0.0)
        assert best.ttft_p99_ms is not None
        pooled = f", each over {aff.runs} runs' calls" if aff.runs > 1 else ""
        spread = p99_gap_interval(aff, best)
        also = ""
        if spread is not None:
            low, high = spread
            pooled += f"; the gap in 90% of redraws of the runs: {low:+,.0f} to {high:+,.0f} ms"
            # A verdict the runs cannot tell from its opposite says so.
            also = f"{'inside' if low <= 0 <= high else 'beyond'} the runs' spread"
        report.bound(
            f"{w}: {front} TTFT p99 vs the best peer's{after}",
            f"<= {best.front}'s",
            f"{aff.ttft_p99_ms:,.0f} vs {best.ttft_p99_ms:,.0f} ms{pooled}",
            aff.ttft_p99_ms,
            best.ttft_p99_ms,
            lambda gap: f"{gap:,.0f} ms",
            also=also,
        )
    for w in _workloads(results):
        aff = _by(results, front, w)
        if aff is None:
            continue
        value = aff.uncached_max_over_mean
        report.bound(
            f"{w}: {front} max/mean uncached tokens per engine",
            f"<= {BALANCE}",
            fmt(value, 2),
            value,
            BALANCE,
            lambda gap: f"{gap:.2f}",
        )
    aff = _by(results, front, EVICTION)
    ideal = _by(results, IDEAL, EVICTION)
    if aff is not None and ideal is not None and ideal.hit_rate:
        share = aff.hit_rate / ideal.hit_rate
        balance = aff.uncached_max_over_mean
        misses = []
        if share < EVICTION_SHARE:
            misses.append(f"hit rate short by {EVICTION_SHARE - share:.2f} of ideal's")
        if balance is None or balance > BALANCE:
            misses.append(f"max/mean over by {(balance or 0) - BALANCE:.2f}")
        report.goal(
            f"{EVICTION}: {front} without a knob",
            f">= {EVICTION_SHARE} of ideal's hit rate and max/mean <= {BALANCE}",
            f"{share:.2f} of ideal's ({aff.hit_rate:.3f} vs {ideal.hit_rate:.3f}),"
            f" max/mean {fmt(balance, 2)}",
            not misses,
            "; ".join(misses),
        )


def plot_real(report: Report, results: list[RealResult]) -> None:
    """Hit rate, and TTFT p50 and p99, per front end, grouped by workload."""
    workloads = _workloads(results)
    fronts = [f for f in FRONTS if any(r.front == f for r in results)]

    def bars(ax: Any, value: Callable[[RealResult], float | None], label: str, title: str) -> None:
        width = 0.8 / max(1, len(fronts))
        for i, front in enumerate(fronts):
            ys = [
                v if (r := _by(results, front, w)) is not None and (v := value(r)) is not None
                else 0.0
                for w in workloads
            ]  # fmt: skip
            xs = [x + i * width for x in range(len(workloads))]
            ax.bar(xs, ys, width, label=front, color=f"C{i}")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    def hit_rate(ax: Any) -> None:
        bars(ax, lambda r: 100 * r.hit_rate, "prefix cache hit rate, %",
             "Hit rate by front end (real engines)")  # fmt: skip

    def ttft(axes: Any) -> None:
        p50, p99 = axes
        bars(p50, lambda r: r.ttft_p50_ms, "TTFT p50, ms", "Time to first token, median")
        bars(p99, lambda r: r.ttft_p99_ms, "TTFT p99, ms", "Time to first token, p99")

    def balance(ax: Any) -> None:
        bars(ax, lambda r: r.uncached_max_over_mean, "max / mean uncached tokens per engine",
             f"Balance of uncached work (goal: <= {BALANCE})")  # fmt: skip
        ax.axhline(BALANCE, color="grey", linestyle="dotted")

    report.plot("routing_real_hit_rate", hit_rate, (11, 4.5))
    report.plot("routing_real_ttft", ttft, (11, 8), rows=2)
    report.plot("routing_real_balance", balance, (11, 4.5))
