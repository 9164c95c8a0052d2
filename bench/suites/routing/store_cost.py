"""What the shared placement store adds per request, through real gateways.

`python -m bench.suites.routing --store-cost`: one redis-server, two simulated engines with
zero latency, and two gateways before them, alike but for `routing.store_url`. Small
chat requests (a new conversation, then two follow-up turns) go one at a time to
each gateway in turn, in blocks, so both see the same machine load; the client's time
per request and each gateway's CPU time are compared. With two engines the policy
runs in both (with one, no policy runs and nothing would be measured).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness.process_tree import cpu_seconds
from bench.harness.redis_server import RedisServer
from bench.harness.server import free_port
from bench.suites.fleet import BENCH_KEY, CpuPlan, Fleet
from bench.suites.routing.options import MODEL


def _body(conversation: int, turns: int) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer briefly."}]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"Answer {t}."})
        messages.append(
            {"role": "user", "content": f"Question {t} of conversation {conversation}."}
        )
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


def store_cost(conversations: int = 600, block: int = 50) -> None:
    """Prints p50 / p90 client time per request, and gateway CPU per request, with and
    without the store."""
    headers = {"Authorization": f"Bearer {BENCH_KEY}"}
    with tempfile.TemporaryDirectory(prefix="bench-store-cost-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        with (
            RedisServer(port, workdir / "redis.log") as redis,
            Fleet(workdir, CpuPlan(None, None)) as fleet,
        ):
            sims = [fleet.sim("--latency", "zero", name=f"sim-{i}") for i in range(2)]
            engines = [s.url for s in sims]
            env = {"GATEWAY_LOG_LEVEL": "warning"}
            gateways = {
                "without the store": fleet.gateway(engines, env, name="gw-plain"),
                "with the store": fleet.gateway(
                    engines, {**env, "GATEWAY_ROUTING__STORE_URL": redis.url}, name="gw-store"
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in gateways}
            cpu: dict[str, float] = dict.fromkeys(gateways, 0.0)
            with httpx.Client(timeout=10) as client:
                # Warm both (connections, the script loaded into Redis).
                for gw in gateways.values():
                    for c in range(20):
                        client.post(
                            gw.url + "/v1/chat/completions", json=_body(-c - 1, 1), headers=headers
                        )
                for start in range(0, conversations, block):
                    for name, gw in gateways.items():
                        pid = gw.pid
                        assert pid is not None
                        before = cpu_seconds(pid)
                        for c in range(start, start + block):
                            for turns in (1, 2, 3):
                                began = time.perf_counter()
                                r = client.post(
                                    gw.url + "/v1/chat/completions",
                                    json=_body(c, turns),
                                    headers=headers,
                                )
                                times[name].append(time.perf_counter() - began)
                                r.raise_for_status()
                        cpu[name] += cpu_seconds(pid) - before
    for name, values in times.items():
        values.sort()
        p50 = statistics.median(values) * 1e6
        p90 = values[int(0.9 * len(values))] * 1e6
        per_request = cpu[name] / len(values) * 1e6
        print(
            f"{name}: {len(values)} requests, p50 {p50:.0f} us, p90 {p90:.0f} us, "
            f"gateway CPU {per_request:.0f} us per request"
        )
    plain, store = (statistics.median(times[n]) * 1e6 for n in gateways)
    print(f"added by the store at the median: {store - plain:.0f} us")
