"""`python -m bench.suites.instructions`: CPU instructions per request, the gateway against
the routers.

A load-independent comparison: each proxy runs under valgrind's callgrind in front of
zero-latency simulated engines (not under valgrind). Per proxy and case, after a warm-up
the counters are zeroed, N requests go over one keep-alive connection and the counts are
dumped, a few times; the least count per request is taken (timed background work only
adds). Counts are the whole process's user-space instructions (every thread): the
server, the event loop, the upstream client and the interpreter alike; system calls'
kernel time is not in them.

Two rows. One engine, one small request: the gateway, vllm-router and sglang-router
(round_robin); issue 30's goal 2 is graded on the gateway's counts here. Two engines,
the cache-aware row (bench/suites/cache_aware.py): the gateway with affinity against
vllm-router's and sglang-router's cache_aware, on 12 conversations under one system
prompt sent in turn; goal 1 is graded there.

Needs `valgrind` (apt-get install valgrind). With `--baseline-tree DIR` another
checkout's gateway is measured too (before and after a change). Each window's dump stays
in the work directory (`NAME.cg.N`, in the order measured), with the report
(`report.md`, `results.json`): `callgrind_annotate --inclusive=yes` breaks a dump down
by C function (Python code shows as the interpreter's). About four minutes a proxy at
the defaults.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench.harness.server import Server
from bench.suites import cache_aware
from bench.suites.fleet import BENCH_KEY, CpuPlan, Fleet, Target, discover_model
from bench.suites.loadgen import KeepAliveClient, raw_request
from bench.suites.overhead import CHAT, small_chat
from bench.suites.report import Report, progress

# Python under callgrind runs some 50-100 times slower: its start takes a minute here.
START_TIMEOUT = 600.0
CASES = {"small chat": (False, 8), "16-token stream": (True, 16)}
# Under callgrind a request takes some 50 times its usual time, so timed background work
# weighs 50 times more per request: the gateway's health checks at vllm-router's default
# cadence (60 s) and no load scrapes.
QUIET = {"GATEWAY_ROUTING__HEALTH_INTERVAL": "60", "GATEWAY_ROUTING__LOAD_INTERVAL": "0"}

_TOTALS = re.compile(rb"^(?:totals|summary):\s+(\d+)", re.MULTILINE)


def dump_total(text: bytes) -> int:
    """The instruction count of one callgrind dump (its `totals:` line, else `summary:`)."""
    found = dict.fromkeys((b"totals", b"summary"), -1)
    for m in _TOTALS.finditer(text):
        found[m.group(0).split(b":", 1)[0]] = int(m.group(1))
    value = found[b"totals"] if found[b"totals"] >= 0 else found[b"summary"]
    if value < 0:
        raise ValueError("no totals or summary line in the callgrind dump")
    return value


def per_request(windows: Sequence[tuple[int, int]]) -> float:
    """Instructions per request from (instructions, requests) windows: the least per
    request. Timed background work (health checks, the allocator's trim) only ever adds
    to a window, so the smallest is the one it stayed out of."""
    if not windows or any(requests <= 0 for _, requests in windows):
        raise ValueError("every window needs requests")
    return min(count / requests for count, requests in windows)


class Callgrind:
    """Zero and dump the counters of a process running under callgrind."""

    def __init__(self, pid: int, out_base: Path) -> None:
        self.pid, self.out_base = pid, out_base

    def _control(self, option: str) -> None:
        subprocess.run(
            ["callgrind_control", option, str(self.pid)],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def zero(self) -> None:
        self._control("-z")

    def dump(self) -> tuple[int, Path]:
        """The count since the last zero, and the dump file that holds it."""
        before = set(self.out_base.parent.glob(self.out_base.name + ".*"))
        self._control("-d")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(self.out_base.parent.glob(self.out_base.name + ".*")) - before
            for path in new:
                text = path.read_bytes()
                if b"\ntotals:" in text or b"\nsummary:" in text:
                    return dump_total(text), path
            time.sleep(0.2)
        raise RuntimeError(f"callgrind wrote no dump for pid {self.pid}")


def window(
    cg: Callgrind, client: KeepAliveClient, raws: Sequence[bytes], requests: int, start: int = 0
) -> int:
    """The instructions the process ran while serving `requests` requests of `raws`, in
    turn from `raws[start]`."""
    cg.zero()
    for i in range(requests):
        status = client.send(raws[(start + i) % len(raws)]).status
        if status != 200:
            raise RuntimeError(f"status {status}")
    count, _ = cg.dump()
    return count


def measure(
    cg: Callgrind,
    target: Target,
    cases: Mapping[str, Sequence[bytes]],
    requests: int,
    warmup: int,
    repeats: int,
) -> dict[str, float]:
    """Instructions per request of each case (its bodies sent in turn), over one
    keep-alive connection."""
    out: dict[str, float] = {}
    with KeepAliveClient(target.host, target.port, timeout=120) as client:
        for case, bodies in cases.items():
            raws = [raw_request(target, CHAT, body) for body in bodies]
            for i in range(warmup):
                client.send(raws[i % len(raws)])
            windows = [
                (window(cg, client, raws, requests, warmup + r * requests), requests)
                for r in range(repeats)
            ]
            out[case] = per_request(windows)
            counts = ", ".join(f"{c / requests / 1000:.0f}K" for c, _ in windows)
            progress(f"{target.name}: {case}: {out[case] / 1000:.0f}K a request ({counts})")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.suites.instructions", description=__doc__)
    p.add_argument("--requests", type=int, default=300, help="measured requests per case")
    p.add_argument("--warmup", type=int, default=100, help="requests before each count")
    p.add_argument("--repeats", type=int, default=3, help="counted windows per case")
    p.add_argument("--baseline-tree", type=Path, help="also measure this checkout's gateway")
    p.add_argument("--no-router", action="store_true", help="skip vllm-router and sglang-router")
    p.add_argument(
        "--no-cache-aware", action="store_true", help="skip the two-engine cache-aware row"
    )
    p.add_argument("--no-gateway", action="store_true", help="skip this checkout's gateway")
    p.add_argument("--workdir", type=Path, help="keep logs and dumps here (default: a temp dir)")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Run:
    """One proxy to count: its name, whether it is in the two-engine row, and how the
    fleet starts it (under `wrap`) in front of the engines; None when not installed."""

    name: str
    two_engines: bool
    start: Callable[[Fleet, list[str], list[str]], Server | None]
    headers: dict[str, str]


GATEWAY_HEADERS = {"Authorization": f"Bearer {BENCH_KEY}"}


def _gateway(
    fleet: Fleet,
    engines: list[str],
    wrap: list[str],
    name: str,
    tree: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Server:
    settings = {**QUIET, **(env or {})}
    return fleet.gateway(
        engines, settings, name=name, pin=False, tree=tree, wrap=wrap, timeout=START_TIMEOUT
    )


def _router(
    fleet: Fleet, engines: list[str], wrap: list[str], peer: str, policy: str, name: str
) -> Server | None:
    start = fleet.vllm_router if peer == "vllm-router" else fleet.sglang_router
    return start(engines, policy, name, wrap, START_TIMEOUT)


def runs(args: argparse.Namespace) -> list[Run]:
    """The proxies the options ask for, in the order they are counted."""
    out: list[Run] = []
    gateways = [("gateway", None)] if not args.no_gateway else []
    if args.baseline_tree is not None:
        gateways.append(("gateway-baseline", args.baseline_tree))
    for name, tree in gateways:
        out.append(Run(name, False, partial(_gateway, name=name, tree=tree), GATEWAY_HEADERS))
    routers = [] if args.no_router else ["vllm-router", "sglang-router"]
    for peer in routers:
        start = partial(_router, peer=peer, policy="round_robin", name=peer)
        out.append(Run(peer, False, start, {}))
    if args.no_cache_aware:
        return out
    if not args.no_gateway:
        affinity = partial(_gateway, name="gateway-affinity", env=cache_aware.GATEWAY_ENV)
        out.append(Run(cache_aware.GATEWAY, True, affinity, GATEWAY_HEADERS))
    for peer, name in zip(["vllm-router", "sglang-router"], cache_aware.ROUTERS, strict=True):
        if peer in routers:
            start = partial(_router, peer=peer, policy="cache_aware", name=name.replace(" ", "-"))
            out.append(Run(name, True, start, {}))
    return out


def tables(report: Report, results: Mapping[str, Mapping[str, float]], row: set[str]) -> None:
    """The counts, one table per row (one engine; two engines, the cache-aware row)."""
    for two, title in (
        (False, "Instructions per request, one engine, one small request"),
        (True, "Instructions per request, two engines, 12 conversations in turn"),
    ):
        names = [n for n in results if (n in row) == two]
        if names:
            rows = [[case, *(f"{results[n][case] / 1000:.0f}K" for n in names)] for case in CASES]
            report.table(title, ["case", *names], rows)


def grade(report: Report, results: Mapping[str, Mapping[str, float]], row: set[str]) -> None:
    """Issue 30's goal 2 on the one-engine gateway, goal 1 on the cache-aware row."""
    if "gateway" in results:
        cache_aware.instruction_goals(report, results["gateway"])
    if cache_aware.GATEWAY in results:
        cache_aware.goals(
            report,
            {
                case: {
                    "instructions per request": {n: results[n][case] for n in results if n in row}
                }
                for case in CASES
            },
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report.create("instructions", workdir)
    results: dict[str, dict[str, float]] = {}
    row: set[str] = set()
    with Fleet(workdir, CpuPlan(None, None)) as fleet:
        sims = fleet.at_once(
            *(
                partial(fleet.sim, "--latency", "zero", "--runner", "generate", name=f"sim-{n}")
                for n in ("a", "b")
            )
        )
        urls = [s.url for s in sims]
        model = discover_model(Target("direct", urls[0]))
        one = {
            case: [small_chat(model, stream, tokens)] for case, (stream, tokens) in CASES.items()
        }
        two = {
            case: list(cache_aware.bodies(model, stream, tokens))
            for case, (stream, tokens) in CASES.items()
        }
        for run in runs(args):
            progress(f"{run.name}: starting under callgrind")
            out_base = workdir / f"{run.name.replace(' ', '-')}.cg"
            wrap = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_base}"]
            server = run.start(fleet, urls if run.two_engines else urls[:1], wrap)
            if server is None:
                report.note(f"{run.name}: not installed, skipped")
                continue
            assert server.pid is not None
            target = Target(run.name, server.url, run.headers)
            cg = Callgrind(server.pid, out_base)
            cases = two if run.two_engines else one
            results[run.name] = measure(cg, target, cases, args.requests, args.warmup, args.repeats)
            if run.two_engines:
                row.add(run.name)
            server.stop()
    tables(report, results, row)
    grade(report, results, row)
    report.raw["instructions_per_request"] = results
    report.write()
    print(f"\nwork directory {workdir}")
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
