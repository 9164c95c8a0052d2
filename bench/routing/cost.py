"""What the affinity policy costs per request, timed in-process."""

from __future__ import annotations

import random
from typing import Any

from bench.routing.inprocess import Engine
from bench.routing.options import MODEL
from bench.workloads import words


def policy_cost() -> None:
    """Microseconds per `Affinity.order()` call (best of 10 runs of 2,000 calls: the
    least disturbed by other processes) on a 2k-token chat body and an 8 kB prompt."""
    import timeit

    from gateway.routing.keys import candidate_anchors
    from gateway.routing.policy import Affinity, RoutingRequest
    from gateway.routing.settings import RoutingSettings

    rng = random.Random(1)
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, 1000)}]
    for _ in range(4):
        messages.append({"role": "user", "content": words(rng, 100)})
        messages.append({"role": "assistant", "content": words(rng, 150)})
    messages.append({"role": "user", "content": words(rng, 20)})
    bodies: dict[str, dict[str, Any]] = {
        "chat, 2k tokens, 10 messages": {"model": MODEL, "messages": messages},
        "prompt, 8 kB": {"model": MODEL, "prompt": words(rng, 2000)},
    }
    pool = [Engine(f"http://10.0.0.{i}:8000") for i in range(4)]
    policy = Affinity(RoutingSettings())
    for name, body in bodies.items():

        def call(body: dict[str, Any] = body) -> None:
            policy.order(RoutingRequest("/v1/chat/completions", body=body), pool)

        def keys(body: dict[str, Any] = body) -> None:
            candidate_anchors(body)

        order_us = min(timeit.repeat(call, number=2000, repeat=10)) / 2000 * 1e6
        keys_us = min(timeit.repeat(keys, number=2000, repeat=10)) / 2000 * 1e6
        print(f"{name}: order() {order_us:.1f} us per call, of which anchors {keys_us:.1f} us")
