"""A key's engine errors counted across replicas through the shared store: real
processes, redis-server, one simulated engine whose model does not serve /v1/systemone
(501, as vLLM answers for a Llama), two gateway replicas. What reached the engine is read
from the engine's own counters. Marked `redis` (scripts/test-store.sh)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.harness.redis_server import RedisServer
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    error_code,
    free_port,
    gateway_proc,
    metric,
    running,
    sim_proc,
    sim_received,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ATTACKER = "sk-key-errors-attacker-0123456789abcdef"
VICTIM = "sk-key-errors-victim-0123456789abcdef"
LIMIT = 6
WINDOW = 3600
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# A completion the calibrated simulated engine takes seconds to generate (8 ms a token).
LONG = {"model": MODEL, "prompt": "count", "max_tokens": 600, "ignore_eos": True}
DECISION = {
    "model": MODEL,
    "state": "a photo",
    "questions": {"q1": {"type": "yes_no", "instructions": "Is there a cat?"}},
}


@contextmanager
def _stack(tmp_path: Path, *sim_opts: str, **extra: str) -> Iterator[tuple[Proc, list[Proc]]]:
    store = RedisServer(free_port(), tmp_path / "redis.log")
    store.start()
    try:
        sim = sim_proc(tmp_path, *sim_opts)
        env = {
            "GATEWAY_ENGINES": json.dumps([sim.url]),
            "GATEWAY_API_KEYS": json.dumps([ATTACKER, VICTIM]),
            "GATEWAY_PUBLIC_METRICS": "true",
            "GATEWAY_STORE_URL": store.url,
            "GATEWAY_STORE_PREFIX": f"test-{uuid.uuid4().hex[:8]}",
            "GATEWAY_STORE_TIMEOUT": "1.0",
            "GATEWAY_ROUTING__KEY_ERRORS": str(LIMIT),
            "GATEWAY_ROUTING__KEY_ERRORS_WINDOW": str(WINDOW),
            **extra,
        }
        replicas = [gateway_proc(tmp_path, env), gateway_proc(tmp_path, env)]
        with running(sim), running(*replicas, ready_path="/readyz"):
            yield sim, replicas
    finally:
        store.stop()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Proc, list[Proc]]]:
    with _stack(tmp_path, "--latency", "zero", "--not-implemented", "/v1/systemone") as s:
        yield s


def _same_window() -> None:
    """The window is aligned to the epoch: wait out its last minute, so all fall in one."""
    left = WINDOW - time.time() % WINDOW
    if left < 60:
        time.sleep(left + 1)


def test_a_keys_engine_errors_count_across_replicas(stack: tuple[Proc, list[Proc]]) -> None:
    """Twenty /v1/systemone of one key, through two replicas in turn: the store's count
    throttles it after LIMIT 501s in all, plus the one a replica sends before it learns
    (each would send LIMIT on its own count: 12). The 429s reach no engine; another
    key's chats through both are all 200 and no engine is ejected."""
    _same_window()
    sim, replicas = stack
    before = sim_received(sim.url)
    answers: list[tuple[int, str | None]] = []
    chats: list[int] = []
    with httpx.Client(timeout=30) as client:
        for n in range(20):
            url = replicas[n % 2].url
            r = client.post(url + "/v1/systemone", json=DECISION, headers=auth(ATTACKER))
            answers.append((r.status_code, error_code(r)))
            chat = client.post(url + "/v1/chat/completions", json=CHAT, headers=auth(VICTIM))
            chats.append(chat.status_code)
    expected = [(501, "engine_error")] * (LIMIT + 1)
    assert answers == expected + [(429, "too_many_engine_errors")] * (20 - LIMIT - 1)
    assert sim_received(sim.url) == before + LIMIT + 1 + 20
    assert chats == [200] * 20
    for gateway in replicas:
        assert metric(gateway.url, "gateway_engine_ejections_total", engine=sim.url) == 0


def test_a_keys_timeouts_count_across_replicas(tmp_path: Path) -> None:
    """One key's completions that outlast timeouts.first_byte (0.5 s; the calibrated
    simulated engine takes seconds for LONG), through two replicas in turn: they count
    like its 501s, so the store throttles it after LIMIT + 1 timeouts in all; another
    key's chats through both are all 200 and no engine is ejected (one key's timeouts
    ejected it before)."""
    with _stack(tmp_path, GATEWAY_TIMEOUTS__FIRST_BYTE="0.5") as (sim, replicas):
        _same_window()
        before = sim_received(sim.url)
        answers: list[tuple[int, str | None]] = []
        chats: list[int] = []
        with httpx.Client(timeout=30) as client:
            for n in range(10):
                url = replicas[n % 2].url
                r = client.post(url + "/v1/completions", json=LONG, headers=auth(ATTACKER))
                answers.append((r.status_code, error_code(r)))
                chat = client.post(url + "/v1/chat/completions", json=CHAT, headers=auth(VICTIM))
                chats.append(chat.status_code)
        expected = [(504, "upstream_timeout")] * (LIMIT + 1)
        assert answers == expected + [(429, "too_many_engine_errors")] * (10 - LIMIT - 1)
        assert sim_received(sim.url) == before + LIMIT + 1 + 10
        assert chats == [200] * 10
        for gateway in replicas:
            assert metric(gateway.url, "gateway_engine_ejections_total", engine=sim.url) == 0
