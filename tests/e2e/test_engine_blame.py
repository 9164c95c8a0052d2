"""Whose failure is it: a gateway under uvicorn before simulated engines and recording
servers on loopback. One key's requests that fail at the engine (vLLM's 501 for a route
its model does not serve, a 500 for some input) throttle that key, never eject the
engine; failures of the engine's own (timeouts, connect errors) and 5xx across keys
still eject; slow health checks never take out the last engine while it answers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.origin import RecordingServer, Route
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    error_code,
    gateway_proc,
    metric,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

ATTACKER = "sk-blame-attacker-0123456789abcdef"
VICTIM = "sk-blame-victim-0123456789abcdef"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DECISION = {
    "model": MODEL,
    "state": "a photo",
    "questions": {"q1": {"type": "yes_no", "instructions": "Is there a cat?"}},
}
MODELS_BODY = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
# A completion the calibrated simulated engine takes seconds to generate (8 ms a token).
LONG = {"model": MODEL, "prompt": "count", "max_tokens": 600, "ignore_eos": True}
CHAT_BODY = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()
JSON = {"Content-Type": "application/json"}


def _env(engines: list[str], **extra: str) -> dict[str, str]:
    return {
        "GATEWAY_ENGINES": json.dumps(engines),
        "GATEWAY_API_KEYS": json.dumps([ATTACKER, VICTIM]),
        "GATEWAY_PUBLIC_METRICS": "true",
        **extra,
    }


def _health_lines(gateway: Proc) -> list[dict[str, Any]]:
    lines = (json.loads(raw) for raw in gateway.log().splitlines() if raw.startswith("{"))
    return [line for line in lines if line.get("event") == "engine_health"]


def _unhealthy(gateway: Proc) -> list[str]:
    return [str(line["reason"]) for line in _health_lines(gateway) if not line["healthy"]]


@pytest.fixture
def unsupported(tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    """A simulated engine whose model does not serve /v1/systemone (vLLM answers 501, as
    for a Llama), and a gateway before it: the attacker's engine 5xx throttle it after
    8 in a window."""
    sim = sim_proc(tmp_path, "--latency", "zero", "--not-implemented", "/v1/systemone")
    gateway = gateway_proc(
        tmp_path,
        _env(
            [sim.url],
            GATEWAY_ROUTING__KEY_ERRORS="8",
            GATEWAY_ROUTING__KEY_ERRORS_WINDOW="3600",
        ),
    )
    with running(sim), running(gateway, ready_path="/readyz"):
        yield sim, gateway


@pytest.mark.slow
def test_one_keys_501s_leave_the_engine_in_rotation_and_throttle_that_key(
    unsupported: tuple[Proc, Proc],
) -> None:
    """30 /v1/systemone from one key (501 at the engine: five in a row ejected it
    before), ten in a row, then each followed by another key's chat: every chat is
    answered 200, the engine is never ejected, and the attacker's requests past 8 are
    answered 429 too_many_engine_errors without reaching the engine."""
    sim, gateway = unsupported
    before = sim_received(sim.url)
    attacker: list[httpx.Response] = []
    victim: list[httpx.Response] = []
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for i in range(30):
            attacker.append(client.post("/v1/systemone", json=DECISION, headers=auth(ATTACKER)))
            if i >= 9:
                chat = client.post("/v1/chat/completions", json=CHAT, headers=auth(VICTIM))
                victim.append(chat)
        victim += [
            client.post("/v1/chat/completions", json=CHAT, headers=auth(VICTIM)) for _ in range(9)
        ]
        ready = client.get("/readyz")
    assert [r.status_code for r in victim] == [200] * 30
    assert [(r.status_code, error_code(r)) for r in attacker[:8]] == [(501, "engine_error")] * 8
    for r in attacker[8:]:
        assert (r.status_code, error_code(r)) == (429, "too_many_engine_errors"), r.text
        assert 0 < int(r.headers["Retry-After"]) <= 3600
    # The refused 22 reached no engine: 8 decisions and 30 chats did.
    assert sim_received(sim.url) == before + 8 + 30
    assert ready.status_code == 200 and ready.json()["healthy_engines"] == 1
    assert metric(gateway.url, "gateway_engine_ejections_total", engine=sim.url) == 0
    assert _unhealthy(gateway) == []


@pytest.mark.slow
def test_one_keys_500s_do_not_eject_and_two_keys_500s_do(tmp_path: Path) -> None:
    """An engine that answers every chat 500, beside a good one (round robin): ten 500s
    for one key leave it in rotation; the first 500 for a second key ends the run of
    five (now across two keys) and ejects it."""
    routes = {
        "/health": Route(200),
        "/v1/models": Route(200, MODELS_BODY, JSON),
        "/v1/chat/completions": Route(500, b'{"error": "boom"}', JSON),
    }
    sim = sim_proc(tmp_path, "--latency", "zero")
    with RecordingServer(routes) as bad, running(sim):
        env = _env(
            [sim.url, bad.url],
            GATEWAY_ROUTING__POLICY="round_robin",
            GATEWAY_ROUTING__EJECT_BACKOFF="60",
            GATEWAY_ROUTING__KEY_ERRORS="0",
        )
        with running(gateway_proc(tmp_path, env), ready_path="/readyz") as (gateway,):
            url = gateway.url + "/v1/chat/completions"
            with httpx.Client(timeout=10) as client:
                one = [client.post(url, json=CHAT, headers=auth(ATTACKER)) for _ in range(20)]
                assert [r.status_code for r in one].count(500) == 10
                assert metric(gateway.url, "gateway_engine_ejections_total", engine=bad.url) == 0
                assert HTTP.get(gateway.url + "/readyz").json()["healthy_engines"] == 2
                two = [client.post(url, json=CHAT, headers=auth(VICTIM)) for _ in range(4)]
            # The victim's first request that reached the bad engine ejected it.
            assert [r.status_code for r in two].count(500) == 1
            assert metric(gateway.url, "gateway_engine_ejections_total", engine=bad.url) == 1
            assert wait_for(lambda: "ejected_5xx" in _unhealthy(gateway), timeout=5)
            assert HTTP.get(gateway.url + "/readyz").json()["healthy_engines"] == 1


def _long_completions(gateway: Proc, key: str, count: int) -> list[httpx.Response]:
    """`count` non-streamed completions of LONG at once for `key`."""
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(HTTP.post, gateway.url + "/v1/completions", json=LONG, headers=auth(key))
            for _ in range(count)
        ]
        return [f.result() for f in futures]


@pytest.mark.slow
def test_one_keys_timeouts_leave_the_engine_in_rotation_and_throttle_that_key(
    tmp_path: Path,
) -> None:
    """The only engine (calibrated latency: LONG takes seconds) and timeouts.first_byte
    0.5 s: one key's five LONG at once all time out (504), then one more; five such
    timeouts ejected the engine, whoever sent them, and every tenant got 503. Now they
    count for that key: past key_errors (6) it is answered 429 before the engine, while
    another key's chats are all answered 200 and the engine never leaves the rotation."""
    sim = sim_proc(tmp_path)
    env = _env(
        [sim.url],
        GATEWAY_TIMEOUTS__FIRST_BYTE="0.5",
        GATEWAY_ROUTING__KEY_ERRORS="6",
        GATEWAY_ROUTING__KEY_ERRORS_WINDOW="3600",
    )
    with running(sim), running(gateway_proc(tmp_path, env), ready_path="/readyz") as (gateway,):
        before = sim_received(sim.url)
        attacker = _long_completions(gateway, ATTACKER, 5)
        url = gateway.url + "/v1/completions"
        with httpx.Client(timeout=30) as client:
            attacker += [client.post(url, json=LONG, headers=auth(ATTACKER)) for _ in range(3)]
            chat = gateway.url + "/v1/chat/completions"
            victim = [client.post(chat, json=CHAT, headers=auth(VICTIM)) for _ in range(30)]
            ready = client.get(gateway.url + "/readyz")
        codes = [(r.status_code, error_code(r)) for r in attacker]
        assert codes[:6] == [(504, "upstream_timeout")] * 6, codes
        assert codes[6:] == [(429, "too_many_engine_errors")] * 2, codes
        assert [r.status_code for r in victim] == [200] * 30
        # The two 429s reached no engine: six completions and 30 chats did.
        assert sim_received(sim.url) == before + 6 + 30
        assert ready.status_code == 200 and ready.json()["healthy_engines"] == 1
        assert metric(gateway.url, "gateway_engine_ejections_total", engine=sim.url) == 0
        assert _unhealthy(gateway) == []


@pytest.mark.slow
def test_timeouts_of_two_keys_eject(tmp_path: Path) -> None:
    """An engine that never starts answering a chat within timeouts.first_byte, beside a
    good one (round robin): ten chats of one key time out five times there and leave it
    in rotation; the first timeout of a second key ends a run of six across two keys
    and ejects it."""
    routes = {
        "/health": Route(200),
        "/v1/models": Route(200, MODELS_BODY, JSON),
        "/v1/chat/completions": Route(200, CHAT_BODY, JSON, delay=3.0),
    }
    sim = sim_proc(tmp_path, "--latency", "zero")
    with RecordingServer(routes) as slow, running(sim):
        env = _env(
            [sim.url, slow.url],
            GATEWAY_ROUTING__POLICY="round_robin",
            GATEWAY_ROUTING__EJECT_BACKOFF="60",
            GATEWAY_ROUTING__KEY_ERRORS="0",
            GATEWAY_TIMEOUTS__FIRST_BYTE="0.3",
        )
        with running(gateway_proc(tmp_path, env), ready_path="/readyz") as (gateway,):
            url = gateway.url + "/v1/chat/completions"
            with httpx.Client(timeout=10) as client:
                one = [client.post(url, json=CHAT, headers=auth(ATTACKER)) for _ in range(10)]
                timeouts = [r for r in one if r.status_code == 504]
                assert len(timeouts) == 5
                assert {error_code(r) for r in timeouts} == {"upstream_timeout"}
                assert metric(gateway.url, "gateway_engine_ejections_total", engine=slow.url) == 0
                assert HTTP.get(gateway.url + "/readyz").json()["healthy_engines"] == 2
                two = [client.post(url, json=CHAT, headers=auth(VICTIM)) for _ in range(6)]
            # The victim's first request that reached the slow engine ejected it.
            assert [r.status_code for r in two].count(504) == 1
            assert [r.status_code for r in two].count(200) == 5
            assert metric(gateway.url, "gateway_engine_ejections_total", engine=slow.url) == 1
            assert wait_for(lambda: "ejected_5xx" in _unhealthy(gateway), timeout=5)


@pytest.mark.slow
def test_an_engine_silent_to_its_checks_goes_out_with_one_keys_timeouts(
    tmp_path: Path,
) -> None:
    """The only engine answered a chat just now, then stops answering /health: while it
    may still be answering, slowness alone keeps the last engine (busy_grace 60 s here).
    One key's timeout says it is not: the next timed-out check takes it out (reason
    `timeout`), though one key's timeouts alone never eject."""
    sim = sim_proc(tmp_path)
    env = _env(
        [sim.url],
        GATEWAY_TIMEOUTS__FIRST_BYTE="0.5",
        GATEWAY_ROUTING__HEALTH_INTERVAL="0.1",
        GATEWAY_ROUTING__HEALTH_TIMEOUT="0.2",
        GATEWAY_ROUTING__BUSY_GRACE="60",
    )
    with running(sim), running(gateway_proc(tmp_path, env), ready_path="/readyz") as (gateway,):
        with httpx.Client(timeout=30) as client:
            chat = client.post(
                gateway.url + "/v1/chat/completions", json=CHAT, headers=auth(VICTIM)
            )
            assert chat.status_code == 200
            assert client.put(sim.url + "/sim/health-delay", content=b"30").status_code == 200
            assert wait_for(lambda: '"engine_health_slow"' in gateway.log(), timeout=10)
            assert _unhealthy(gateway) == []
            late = client.post(gateway.url + "/v1/completions", json=LONG, headers=auth(ATTACKER))
        assert (late.status_code, error_code(late)) == (504, "upstream_timeout")
        assert wait_for(lambda: _unhealthy(gateway) == ["timeout"], timeout=10), gateway.log_tail()
        assert metric(gateway.url, "gateway_engine_ejections_total", engine=sim.url) == 0


@pytest.mark.slow
def test_slow_health_never_takes_out_the_last_engine_that_answers(tmp_path: Path) -> None:
    """The only engine answers /health in 0.6 s (the checks allow 0.2 s) while it answers
    chats at once: a steady stream of chats for three times busy_grace is answered 200
    every time, the engine never leaves the rotation. Once the chats stop, its timeouts
    take it out after busy_grace."""
    sim = sim_proc(tmp_path, "--latency", "zero")
    env = _env(
        [sim.url],
        GATEWAY_ROUTING__HEALTH_INTERVAL="0.1",
        GATEWAY_ROUTING__HEALTH_TIMEOUT="0.2",
        GATEWAY_ROUTING__BUSY_GRACE="1",
    )
    with running(sim), running(gateway_proc(tmp_path, env), ready_path="/readyz") as (gateway,):
        url = gateway.url + "/v1/chat/completions"
        with httpx.Client(timeout=10) as client:
            assert client.put(sim.url + "/sim/health-delay", content=b"0.6").status_code == 200
            statuses: list[int] = []
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                statuses.append(client.post(url, json=CHAT, headers=auth(VICTIM)).status_code)
                time.sleep(0.05)
        slow = [
            json.loads(raw)
            for raw in gateway.log().splitlines()
            if raw.startswith("{") and '"engine_health_slow"' in raw
        ]
        assert slow, gateway.log_tail()  # the checks did time out meanwhile
        assert set(statuses) == {200} and len(statuses) > 10
        assert _unhealthy(gateway) == []
        # Idle now: slowness takes it out once no answer is within busy_grace.
        assert wait_for(lambda: _unhealthy(gateway) == ["timeout"], timeout=10)
