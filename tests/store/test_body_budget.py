"""The body budget with the shared store: memory is per process, so a key's body bytes
are counted by the process that holds them, store or not. Real processes: redis-server,
a simulated engine that runs one request at a time, a gateway with a store, a key with
its own `max_in_flight` (shared through the store). Marked `redis`
(scripts/test-store.sh)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.redis_server import RedisServer
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    auth,
    error_code,
    free_port,
    gateway_proc,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEY = "sk-body-budget-store-0123456789abcdef"
OTHER = "sk-body-budget-other-0123456789abcdef"


def _padded(size: int, **fields: object) -> dict[str, object]:
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    return {**chat, **fields, "user": "b" * size}


def test_a_keys_bodies_are_bounded_by_the_process_holding_them_with_a_store(
    tmp_path: Path,
) -> None:
    """The key's 400 kB chat waits at the engine; its next 400 kB chat (800 kB with its
    parse) would take it past its 1 MB and is 429 too_many_body_bytes, nothing of it at
    the engine; admitted through the store's in-flight cap first, as before. Served once
    the first is answered."""
    store = RedisServer(free_port(), tmp_path / "redis.log")
    store.start()
    try:
        sim = sim_proc(tmp_path, "--max-num-seqs", "1")
        keys = [{"key": KEY, "name": "budget", "max_in_flight": 8}, {"key": OTHER, "name": "other"}]
        env = {
            "GATEWAY_ENGINES": json.dumps([sim.url]),
            "GATEWAY_API_KEYS": json.dumps(keys),
            "GATEWAY_STORE_URL": store.url,
            "GATEWAY_LIMITS__MAX_BUFFERED_BODY_BYTES": "1500000",
            "GATEWAY_LIMITS__MAX_BUFFERED_BODY_BYTES_PER_KEY": "1000000",
        }
        gateway = gateway_proc(tmp_path, env)
        with running(sim), running(gateway, ready_path="/readyz"):
            url = gateway.url + "/v1/chat/completions"
            before = sim_received(sim.url)
            answers: list[httpx.Response] = []
            slow = _padded(400_000, max_tokens=500, ignore_eos=True)
            held = threading.Thread(
                target=lambda: answers.append(
                    HTTP.post(url, json=slow, headers=auth(KEY), timeout=60)
                )
            )
            held.start()
            try:
                assert wait_for(lambda: sim_received(sim.url) == before + 1, timeout=30)
                resp = HTTP.post(url, json=_padded(400_000), headers=auth(KEY), timeout=30)
                assert (resp.status_code, error_code(resp)) == (429, "too_many_body_bytes")
                assert resp.headers["retry-after"] == "1"
                assert sim_received(sim.url) == before + 1
            finally:
                held.join()
            assert [a.status_code for a in answers] == [200]
            assert (
                HTTP.post(url, json=_padded(400_000), headers=auth(KEY), timeout=30).status_code
                == 200
            )
            assert sim_received(sim.url) == before + 2
    finally:
        store.stop()
