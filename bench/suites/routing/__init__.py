"""Routing benchmark: prefix-cache hit rate, TTFT and load balance per routing policy.

`python -m bench.suites.routing` (or `python -m bench routing`, which calls `main`). For each
front end it starts fresh simulated engines (calibrated latency, a KV cache small enough
that eviction matters), puts the front end before them and replays the same workloads
(bench/suites/routing/workloads.py) through it:

- ideal: one engine with all four engines' cache, driven directly (zero latency: its hit
  rate is the ceiling; one engine doing four engines' work has no comparable TTFT);
- the gateway with `affinity`, `round_robin` and `least_loaded`;
- vllm-router (PyPI `vllm-router`, Rust) with its `cache_aware` policy, when installed
  (`.venv/bin/pip install vllm-router`; it is not a project dependency);
- each of these with 2 and 4 replicas taking the requests in turn, as behind a plain
  load balancer (`--replicas`);
- with `--store`, affinity with the shared placement store ("affinity + store"): a
  fresh redis-server on a free loopback port for every row, stopped by its PID;
- with `--merge DIR`, the rows of the front ends not run now are taken from an
  earlier run's results.json (named in the report), to rerun some rows of a table.

Hit rates and uncached prompt tokens come from the engines' own counters
(`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`, deltas per workload);
load is the requests each engine received (`sim:received_requests_total`), max / mean;
TTFT is measured by the client (first streamed chunk), so it includes the front end.
Follow-up agreement comes from the engines' request recorders: which engine each call's
X-Request-Id reached (bench/README.md defines it).

The package, by concern: `options` (what a run measures), `client` (sessions replayed over
HTTP), `fronts` (the front ends compared), `live` (one run on fresh engines), `inprocess`
(the offline replay, `--offline`), `cost` (`--cost`), `report` (tables, goals, plots).
`--real-vllm` runs the comparison on real vLLM engines instead: `real` (the run),
`real_workloads`, `engine_set` (the engines, reset between front ends), `real_report`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.suites.fleet import CpuPlan
from bench.suites.report import Report, progress
from bench.suites.routing.cost import policy_cost
from bench.suites.routing.fronts import FAMILIES, front_name, fronts, router_installed
from bench.suites.routing.inprocess import OfflineResult, offline, run_offline
from bench.suites.routing.live import Result, merged_rows, run_front
from bench.suites.routing.options import MODEL, Options
from bench.suites.routing.report import write_report
from bench.suites.routing.store_cost import store_cost
from bench.suites.routing.workloads import build

__all__ = ["MODEL", "OfflineResult", "Options", "Result", "main", "offline", "parse_args"]


def parse_args(argv: Sequence[str] | None) -> tuple[Options, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.suites.routing", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a quarter of the requests")
    p.add_argument("--scale", type=float, default=None, help="workload size factor (default 1)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="per engine")
    p.add_argument("--workload", action="append", default=[], help="repeatable; default all")
    p.add_argument(
        "--front",
        action="append",
        default=[],
        help="only front ends whose name starts with this (repeatable)",
    )
    p.add_argument("--load-epsilon", type=float, default=None, help="the gateway's load bound")
    p.add_argument(
        "--store",
        action="store_true",
        help="also run affinity with the shared placement store (needs redis-server)",
    )
    p.add_argument(
        "--merge",
        type=Path,
        metavar="DIR",
        help="take the rows of front ends not run now from DIR/results.json",
    )
    p.add_argument(
        "--replicas",
        action="append",
        type=int,
        default=[],
        help="replica counts to run (repeatable; default 1, 2 and 4)",
    )
    p.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra gateway setting, e.g. GATEWAY_ROUTING__HOT_DIVISOR=4 (repeatable)",
    )
    p.add_argument("--out", type=Path, help="results folder (default bench/results/<timestamp>)")
    p.add_argument(
        "--offline",
        type=int,
        metavar="DRAWS",
        help="replay in-process over DRAWS sets of engine URLs (no servers), then exit",
    )
    p.add_argument("--cost", action="store_true", help="time the affinity policy, then exit")
    p.add_argument(
        "--store-cost",
        action="store_true",
        help="time requests through gateways with and without the shared store, then exit",
    )
    p.add_argument("--logs", type=Path, help="keep the servers' logs here (default: a temp dir)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    args, _unknown = p.parse_known_args(argv)
    opts = Options(
        kv_cache_tokens=args.kv_cache_tokens,
        concurrency=args.concurrency,
        scale=args.scale if args.scale is not None else (0.25 if args.quick else 1.0),
        fronts=args.front,
        load_epsilon=args.load_epsilon,
        store=args.store,
        gateway_env=dict(item.split("=", 1) for item in args.gateway_env),
    )
    if args.workload:
        opts.workloads = args.workload
    if args.replicas:
        opts.replicas = args.replicas
    return opts, args


def main(argv: Sequence[str] | None = None) -> int:
    if "--real-vllm" in (sys.argv[1:] if argv is None else argv):
        # Real engines: its own options, engines and report (bench/suites/routing/real.py).
        from bench.suites.routing.real import main as real_main

        return real_main(argv)
    opts, args = parse_args(argv)
    if args.cost:
        policy_cost()
        return 0
    if args.store_cost:
        store_cost()
        return 0
    workloads = build(opts.workloads, MODEL, opts.scale)
    if args.offline:
        run_offline(opts, workloads, args.offline)
        return 0
    cpus = CpuPlan(None, None) if args.no_pin else CpuPlan.detect()
    cpus.pin_self()
    report = Report.create("routing", args.out, smoke=args.quick)
    report.meta.update(
        engines=opts.engines,
        kv_cache_tokens_per_engine=opts.kv_cache_tokens,
        concurrency=opts.concurrency,
        scale=opts.scale,
        cpus_plan=cpus.describe(),
    )
    if not router_installed():
        report.note("vllm-router is not installed: `.venv/bin/pip install vllm-router` to compare")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        logs = Path(tmp)
        if args.logs is not None:
            logs = args.logs
            logs.mkdir(parents=True, exist_ok=True)
        for front in fronts(opts):
            progress(f"front end: {front.name}")
            results += run_front(front, workloads, opts, logs, cpus)
    if args.merge is not None:
        results += merged_rows(args.merge, results, workloads)
        report.meta["merged_from"] = f"{args.merge} (the rows of front ends not run now)"
        rank = {front_name(f, n): (n, i) for n in (1, 2, 4) for i, f in enumerate(FAMILIES)}
        results.sort(key=lambda r: rank.get(r.front, (0, -1)))
    write_report(report, results, workloads)
    report.write()
    print(report.summary())
    return 0
