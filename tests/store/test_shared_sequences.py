"""Engine sequences against a key's shared limits: real processes, redis-server, one
simulated engine, two gateway replicas of two workers each on one store. A request
weighs what it makes the engine run (prompts x `n`) on every replica and worker: its
lease in the store has that many members, its rate that many tokens. What reached the
engine is read from the engine's own counters. Marked `redis` (scripts/test-store.sh).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_client

from bench.harness.metrics import HTTP
from bench.harness.redis_server import RedisServer
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    error_code,
    every_worker_lists,
    free_port,
    gateway_proc,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

CAPPED = "sk-shared-seq-capped-0123456789abcdef"
RATED = "sk-shared-seq-rated-0123456789abcdef"
CAP = 8
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
LONG = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
PREFIX = f"test-{uuid.uuid4().hex[:8]}"


def completion(prompts: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [f"p{i}" for i in range(prompts)], "max_tokens": 1}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-sequences")


@pytest.fixture(scope="module")
def store(tmp: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stack(tmp: Path, store: RedisServer) -> Iterator[tuple[Proc, Proc, Proc]]:
    """(engine, replica a, replica b)."""
    keys = [
        {"key": CAPPED, "name": "capped", "max_in_flight": CAP},
        # A token every 20 s: within a test, its burst of 8 and nothing more.
        {"key": RATED, "name": "rated", "rate": {"requests_per_second": 0.05, "burst": 8}},
    ]
    with running(sim_proc(tmp)) as (sim,):
        env = {
            "GATEWAY_ENGINES": json.dumps([sim.url]),
            "GATEWAY_API_KEYS": json.dumps(keys),
            "GATEWAY_STORE_URL": store.url,
            "GATEWAY_STORE_PREFIX": PREFIX,
            # Long enough that a loaded machine's Redis answers in time (a slow answer
            # would fall back to per-process limits).
            "GATEWAY_STORE_TIMEOUT": "1.0",
            "GATEWAY_LIMITS__RATE_WHEN_STORE_DOWN": "refuse",
            "GATEWAY_LIMITS__IN_FLIGHT_WHEN_STORE_DOWN": "refuse",
        }
        procs = [gateway_proc(tmp, env, "--workers", "2") for _ in range(2)]
        try:
            for p in procs:
                p.start("/healthz")
            for p in procs:
                assert wait_for(partial(every_worker_lists, p, 2, MODEL, auth(CAPPED)), 45), p.log()
            yield sim, procs[0], procs[1]
        finally:
            for p in procs:
                p.stop()


def leases(store: RedisServer, key: str) -> int:
    """Members of `key`'s leases set: one per engine sequence it holds."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    with redis_client.Redis(port=store.port) as r:
        return int(r.zcard(f"{PREFIX}:k:{digest}:leases"))


def post(gateway: Proc, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    """On a new connection: either worker may take it."""
    headers = {**auth(key), "Connection": "close"}
    return HTTP.post(gateway.url + path, json=body, headers=headers, timeout=30)


def test_the_in_flight_cap_counts_sequences_across_replicas(
    stack: tuple[Proc, Proc, Proc], store: RedisServer
) -> None:
    """A streamed chat of n: 6 held on replica a holds 6 of the key's 8 in the store:
    on replica b, n: 3 is 429 and reaches no engine, n: 2 fits. Once the stream
    ends, its 6 members are given back and n: 8 fits."""
    sim, a, b = stack

    async def scenario() -> tuple[int, httpx.Response, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as client:
            request = client.stream(
                "POST", "/v1/chat/completions", headers=auth(CAPPED), json={**LONG, "n": 6}
            )
            async with request as held:
                assert held.status_code == 200
                members = leases(store, CAPPED)
                before = sim_received(sim.url)
                over = await asyncio.to_thread(
                    post, b, "/v1/chat/completions", CAPPED, {**CHAT, "n": 3}
                )
                delta = sim_received(sim.url) - before
                fits = await asyncio.to_thread(
                    post, b, "/v1/chat/completions", CAPPED, {**CHAT, "n": 2}
                )
                return members, over, delta, fits

    members, over, delta, fits = asyncio.run(scenario())
    assert members == 6
    assert (over.status_code, error_code(over)) == (429, "rate_limited"), over.text
    assert delta == 0
    assert fits.status_code == 200
    assert wait_for(lambda: leases(store, CAPPED) == 0, 20)
    whole = post(b, "/v1/chat/completions", CAPPED, {**CHAT, "n": CAP})
    assert whole.status_code == 200


def test_the_rate_counts_sequences_across_replicas(stack: tuple[Proc, Proc, Proc]) -> None:
    """A burst of 8 tokens: a completion of 4 prompts on each replica spends it; the
    next request, on either, is 429 and reaches no engine."""
    sim, a, b = stack
    before = sim_received(sim.url)
    spent = [post(g, "/v1/completions", RATED, completion(4)) for g in (a, b)]
    assert [r.status_code for r in spent] == [200, 200]
    for g in (a, b):
        over = post(g, "/v1/chat/completions", RATED, CHAT)
        assert (over.status_code, error_code(over)) == (429, "rate_limited"), over.text
    assert sim_received(sim.url) - before == 2
