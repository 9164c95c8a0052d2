"""What a key's shared limits add per request, through real gateways.

`python -m bench.suites.limits_cost`: one redis-server, one simulated engine with zero
latency, a gateway with the store (`store_url`) and one without. Three kinds of
requests, small chats one at a time in blocks taken in turn so all see the same machine
load: a key without limits through the gateway with the store (no round trip: the
baseline), a key with a rate and its own in-flight cap through the same gateway (one
script per request, one lease released per request), and that key through the gateway
without a store (per-process limits). The client's time per request and the serving
gateway's CPU time per request are compared; the ratios are to the baseline of the same
run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.harness.process_tree import cpu_seconds
from bench.harness.redis_server import RedisServer
from bench.harness.server import Server, free_port
from bench.sim.config import DEFAULT_MODEL
from bench.suites.fleet import BENCH_KEY, CpuPlan, Fleet

MODEL = DEFAULT_MODEL
LIMITED = "bench-limited-key-not-secret"
# Never refused at this pace: the limits are checked, never hit.
KEYS = [
    BENCH_KEY,
    {
        "key": LIMITED,
        "name": "limited",
        "max_in_flight": 64,
        "rate": {"requests_per_second": 1_000_000, "burst": 1_000_000},
    },
]


def limits_cost(requests: int = 3000, block: int = 100) -> dict[str, dict[str, float]]:
    """p50 / p90 client time and gateway CPU per request (microseconds) of each kind."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with tempfile.TemporaryDirectory(prefix="bench-limits-cost-") as tmp:
        workdir = Path(tmp)
        with (
            RedisServer(free_port(), workdir / "redis.log") as redis,
            Fleet(workdir, CpuPlan(None, None)) as fleet,
        ):
            sim = fleet.sim("--latency", "zero")
            env = {"GATEWAY_LOG_LEVEL": "warning", "GATEWAY_API_KEYS": json.dumps(KEYS)}
            stored = fleet.gateway(
                [sim.url], {**env, "GATEWAY_STORE_URL": redis.url}, name="gw-store"
            )
            plain = fleet.gateway([sim.url], env, name="gw-plain")
            kinds: dict[str, tuple[Server, str]] = {
                "unlimited key, store": (stored, BENCH_KEY),
                "limited key, store": (stored, LIMITED),
                "limited key, no store": (plain, LIMITED),
            }
            times: dict[str, list[float]] = {k: [] for k in kinds}
            cpu = dict.fromkeys(kinds, 0.0)
            with httpx.Client(timeout=10) as client:
                for gw, key in kinds.values():  # warm: connections, scripts loaded
                    for _ in range(50):
                        url = gw.url + "/v1/chat/completions"
                        client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
                for _ in range(0, requests, block):
                    for kind, (gw, key) in kinds.items():
                        headers = {"Authorization": f"Bearer {key}"}
                        url = gw.url + "/v1/chat/completions"
                        pid = gw.pid
                        assert pid is not None
                        before = cpu_seconds(pid)
                        for _ in range(block):
                            began = time.perf_counter()
                            r = client.post(url, json=body, headers=headers)
                            times[kind].append(time.perf_counter() - began)
                            r.raise_for_status()
                        cpu[kind] += cpu_seconds(pid) - before
    out: dict[str, dict[str, float]] = {}
    for kind, values in times.items():
        values.sort()
        out[kind] = {
            "p50_us": statistics.median(values) * 1e6,
            "p90_us": values[int(0.9 * len(values))] * 1e6,
            "cpu_us": cpu[kind] / len(values) * 1e6,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suites.limits_cost", description=__doc__)
    p.add_argument("--requests", type=int, default=3000, help="per kind (default: %(default)s)")
    a = p.parse_args(argv)
    results = limits_cost(a.requests)
    base = results["unlimited key, store"]
    for kind, r in results.items():
        print(
            f"{kind}: p50 {r['p50_us']:.0f} us ({r['p50_us'] / base['p50_us']:.2f}x), "
            f"p90 {r['p90_us']:.0f} us, gateway CPU {r['cpu_us']:.0f} us per request "
            f"({r['cpu_us'] / base['cpu_us']:.2f}x)"
        )
    limited = results["limited key, store"]
    print(
        f"added by the shared limits at the median: {limited['p50_us'] - base['p50_us']:.0f} us, "
        f"CPU {limited['cpu_us'] - base['cpu_us']:.0f} us per request"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
