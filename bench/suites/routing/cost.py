"""What the affinity policy costs per request, timed in-process."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

from bench.suites.routing.inprocess import Engine
from bench.suites.routing.options import MODEL
from bench.suites.routing.workloads import words


def _chat(system: dict[str, str], seed: int) -> dict[str, Any]:
    """A 2k-token, 10-message conversation under the shared `system` prompt."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [system]
    for _ in range(4):
        messages.append({"role": "user", "content": words(rng, 100)})
        messages.append({"role": "assistant", "content": words(rng, 150)})
    messages.append({"role": "user", "content": words(rng, 20)})
    return {"model": MODEL, "messages": messages}


def policy_cost() -> None:
    """Microseconds per `Affinity.order()` call (best of 15 runs of 1,000 calls: the
    least disturbed by other processes) over four engines, on 100 different bodies
    after 200 others sharing their prefix, so the shared prefix is hot and spreads, as
    in a running gateway: 2k-token chats under one system prompt, and 8 kB prompts
    sharing 7 kB."""
    import timeit

    from gateway.routing.anchors import candidate_anchors
    from gateway.routing.policy import Affinity, RoutingRequest
    from gateway.routing.settings import RoutingSettings

    rng = random.Random(1)
    system = {"role": "system", "content": words(rng, 1000)}
    shared = words(rng, 1800)

    def prompt(seed: int) -> dict[str, Any]:
        return {"model": MODEL, "prompt": shared + words(random.Random(seed), 200)}

    makers: dict[str, Callable[[int], dict[str, Any]]] = {
        "chat, 2k tokens, 10 messages": lambda seed: _chat(system, seed),
        "prompt, 8 kB, 7 kB shared": prompt,
    }
    pool = [Engine(f"http://10.0.0.{i}:8000") for i in range(4)]
    settings = RoutingSettings()
    for name, make in makers.items():
        policy = Affinity(settings)
        bodies = [make(i) for i in range(300)]
        for body in bodies[:200]:
            policy.order(RoutingRequest("/v1/chat/completions", body=body), pool)
        measured = itertools.cycle(bodies[200:])

        def call(policy: Affinity = policy, measured: Any = measured) -> None:
            policy.order(RoutingRequest("/v1/chat/completions", body=next(measured)), pool)

        def keys(measured: Any = measured) -> None:
            candidate_anchors(
                next(measured),
                block_bytes=settings.prompt_block_bytes,
                max_candidates=settings.max_candidates,
            )

        order_us = min(timeit.repeat(call, number=1000, repeat=15)) / 1000 * 1e6
        keys_us = min(timeit.repeat(keys, number=1000, repeat=15)) / 1000 * 1e6
        print(f"{name}: order() {order_us:.1f} us per call, of which anchors {keys_us:.1f} us")
