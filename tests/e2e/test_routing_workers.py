"""One gateway started with `--workers 2` before four simulated engines: its two worker
processes share no state, and must still keep every conversation on one engine.

Which engine served a request is read from the engines' request recorders (the
`X-Request-Id` each request arrived with), never from the gateway. Each request goes on
a new connection, so the kernel hands requests to both workers, as a load balancer
hands them to replicas; /gateway/status asked on the same connection names the worker
that took each one, and both took a share.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    by_worker,
    every_worker_lists,
    gateway_proc,
    recording_engines,
    running,
    wait_for,
)

KEY = "sk-routing-workers-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ADMIN = "sk-routing-workers-admin-0123456789"
SYSTEM = "You are the support desk of Acme: be brief and kind. " * 30


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Proc, list[Proc]]]:
    with recording_engines(tmp_path, 4, 2000) as sims:
        env = {
            "GATEWAY_ENGINES": json.dumps([s.url for s in sims]),
            "GATEWAY_API_KEYS": json.dumps(
                [KEY, {"key": ADMIN, "name": "ops", "scopes": ["admin"]}]
            ),
            "GATEWAY_ROUTING__POLICY": "affinity",
            "GATEWAY_PUBLIC_METRICS": "true",
        }
        gateway = gateway_proc(tmp_path, env, "--workers", "2")
        with running(gateway, ready_path="/healthz"):
            ready = wait_for(lambda: every_worker_lists(gateway, 2, MODEL, HEADERS), 30)
            assert ready, gateway.log()
            yield gateway, sims


def body(conversation: int, turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"Answer {t} to {conversation}."})
        messages.append({"role": "user", "content": f"Customer {conversation}, question {t}."})
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


def send(gateway: Proc, payload: dict[str, Any], request_id: str) -> int:
    """The request on a new connection, so either worker may take it: that worker's pid."""
    headers = {**HEADERS, "X-Request-Id": request_id}

    def post(client: httpx.Client) -> None:
        r = client.post("/v1/chat/completions", json=payload, headers=headers)
        assert r.status_code == 200, r.text

    [(pid, _)] = by_worker(gateway.url, ADMIN, post, 1)
    return pid


def served(engines: list[Proc]) -> dict[str, int]:
    """Request id -> index of the engine that received it, from the engines' recorders."""
    out: dict[str, int] = {}
    for index, engine in enumerate(engines):
        for entry in HTTP.get(engine.url + "/sim/requests", timeout=5).json():
            request_id = entry["headers"].get("x-request-id", "")
            if entry["path"] == "/v1/chat/completions":
                client_id = request_id.rpartition("-")[0]
                assert client_id not in out, "one request reached two engines"
                out[client_id] = index
    return out


@pytest.mark.slow
def test_two_workers_keep_every_new_conversation_on_one_engine(
    stack: tuple[Proc, list[Proc]],
) -> None:
    gateway, engines = stack
    shares: Counter[int] = Counter()
    for c in range(40):  # warm-up: conversations of one to three turns
        for t in range(1, 2 + c % 3):
            shares[send(gateway, body(c, t), f"warm-{c}-{t}")] += 1
    # 20 new six-turn conversations, taking turns as users do.
    workers: dict[int, set[int]] = {}
    for t in range(1, 7):
        for c in range(100, 120):
            worker = send(gateway, body(c, t), f"conv-{c}-{t}")
            shares[worker] += 1
            workers.setdefault(c, set()).add(worker)
    where = served(engines)
    homes = {c: {where[f"conv-{c}-{t}"] for t in range(1, 7)} for c in range(100, 120)}
    split = {c: h for c, h in homes.items() if len(h) > 1}
    assert not split, f"{len(split)} of 20 conversations split across engines: {split}"
    # ... while the conversations spread over the engines.
    assert len({next(iter(h)) for h in homes.values()}) >= 3
    # Conversations whose turns both workers took (else the test would prove nothing):
    # which worker accepts a connection is the kernel's choice, even or not.
    assert len(shares) == 2 and sum(len(w) == 2 for w in workers.values()) >= 5, shares
