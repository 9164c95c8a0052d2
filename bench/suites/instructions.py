"""`python -m bench.suites.instructions`: CPU instructions per request, gateway against vllm-router.

A load-independent comparison: each proxy runs under valgrind's callgrind in front of the
same zero-latency simulated engine (not under valgrind). Per proxy and case, after a
warm-up the counters are zeroed, N requests go over one keep-alive connection and the
counts are dumped, a few times; the least count per request is taken (timed background
work only adds). Counts are the whole process's user-space instructions (every thread):
the server, the event loop, the upstream client and the interpreter alike; system calls'
kernel time is not in them.

Needs `valgrind` (apt-get install valgrind). With `--baseline-tree DIR` another
checkout's gateway is measured too (before and after a change). Each window's dump stays
in the work directory (`NAME.cg.N`, in the order measured): `callgrind_annotate
--inclusive=yes` breaks one down by C function (Python code shows as the interpreter's).
About four minutes for the gateway, a baseline and vllm-router at the defaults.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.suites.fleet import BENCH_KEY, CpuPlan, Fleet, Target, discover_model
from bench.suites.loadgen import KeepAliveClient, raw_request
from bench.suites.overhead import CHAT, small_chat
from bench.suites.report import progress

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


def window(cg: Callgrind, client: KeepAliveClient, raw: bytes, requests: int) -> int:
    """The instructions the process ran while serving `requests` requests of `raw`."""
    cg.zero()
    for _ in range(requests):
        status = client.send(raw).status
        if status != 200:
            raise RuntimeError(f"status {status}")
    count, _ = cg.dump()
    return count


def measure(
    cg: Callgrind, target: Target, model: str, requests: int, warmup: int, repeats: int
) -> dict[str, float]:
    """Instructions per request of each case, over one keep-alive connection."""
    out: dict[str, float] = {}
    with KeepAliveClient(target.host, target.port, timeout=120) as client:
        for case, (stream, tokens) in CASES.items():
            raw = raw_request(target, CHAT, small_chat(model, stream, tokens))
            for _ in range(warmup):
                client.send(raw)
            windows = [(window(cg, client, raw, requests), requests) for _ in range(repeats)]
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
    p.add_argument("--no-router", action="store_true", help="skip vllm-router")
    p.add_argument("--no-gateway", action="store_true", help="skip this checkout's gateway")
    p.add_argument("--workdir", type=Path, help="keep logs and dumps here (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    with Fleet(workdir, CpuPlan(None, None)) as fleet:
        sim = fleet.sim("--latency", "zero", "--runner", "generate", name="sim")
        model = discover_model(Target("direct", sim.url))
        runs: list[tuple[str, Path | None]] = []
        if not args.no_gateway:
            runs.append(("gateway", None))
        if args.baseline_tree is not None:
            runs.append(("gateway-baseline", args.baseline_tree))
        if not args.no_router:
            runs.append(("vllm-router", None))
        for name, tree in runs:
            progress(f"{name}: starting under callgrind")
            out_base = workdir / f"{name}.cg"
            wrap = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_base}"]
            if name == "vllm-router":
                server = fleet.vllm_router([sim.url], wrap=wrap, timeout=START_TIMEOUT)
                if server is None:
                    print("vllm-router is not installed: skipped", file=sys.stderr)
                    continue
                target = Target(name, server.url)
            else:
                server = fleet.gateway(
                    [sim.url],
                    env=QUIET,
                    name=name,
                    pin=False,
                    tree=tree,
                    wrap=wrap,
                    timeout=START_TIMEOUT,
                )
                target = Target(name, server.url, {"Authorization": f"Bearer {BENCH_KEY}"})
            assert server.pid is not None
            cg = Callgrind(server.pid, out_base)
            results[name] = measure(cg, target, model, args.requests, args.warmup, args.repeats)
            server.stop()
    print(f"\nInstructions per request (callgrind, work directory {workdir}):")
    print(f"| | {' | '.join(results)} |")
    print(f"|---|{'---|' * len(results)}")
    for case in CASES:
        row = [f"{results[n][case] / 1000:.0f}K" for n in results]
        print(f"| {case} | {' | '.join(row)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
