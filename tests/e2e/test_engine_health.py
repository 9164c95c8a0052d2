"""Engine health that explains itself, through a running gateway: each engine's state
change is logged once with its reason, /readyz lists each engine's health and reason
(by index, no address), /gateway/status adds the URL and the detail, and no key or
engine answer shows in any of them.

The engines: nothing listening (refused), a simulated engine started with another key
(401 on /v1/models), a loopback server whose model list is not JSON, and a socket that
accepts connections and never answers (timeout). Two of them recover."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bench.harness.metrics import HTTP
from bench.harness.origin import RecordingServer, Route
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    free_port,
    gateway_proc,
    metric,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

UPSTREAM = "upstream-health-0123456789-SECRET"
ENGINE_KEY = "engine-health-other-0123456789-SECRET"
ADMIN = "sk-health-admin-0123456789-SECRET"
SECRETS = (UPSTREAM, ENGINE_KEY, ADMIN)
# The unreadable engine's answer: never echoed by the gateway.
GARBAGE = b"<html>GARBAGE-MODELS-PAGE</html>"
MODELS_BODY = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
JSON = {"Content-Type": "application/json"}

# --- tables ------------------------------------------------------------------------------


# --- the running gateway -------------------------------------------------------------------


class Silent:
    """A socket that takes connections (the kernel completes them) and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen(1024)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def health_lines(gateway: Proc, event: str = "engine_health") -> list[dict[str, Any]]:
    return [
        line
        for line in (json.loads(raw) for raw in gateway.log().splitlines() if raw.startswith("{"))
        if line.get("event") == event
    ]


def reasons_by_engine(gateway: Proc) -> dict[str, list[str | None]]:
    seen: dict[str, list[str | None]] = {}
    for line in health_lines(gateway):
        seen.setdefault(line["engine"], []).append(line["reason"])
    return seen


def status(gateway: Proc) -> dict[str, Any]:
    r = HTTP.get(gateway.url + "/gateway/status", headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text
        assert "GARBAGE" not in text and "Unauthorized" not in text


@pytest.fixture
def silent() -> Iterator[Silent]:
    s = Silent()
    try:
        yield s
    finally:
        s.close()


@pytest.mark.slow
def test_each_engine_says_why_it_is_down_and_recovers_once(tmp_path: Path, silent: Silent) -> None:
    down_port = free_port()
    down = f"http://127.0.0.1:{down_port}"
    wrong_key = sim_proc(tmp_path, "--api-key", ENGINE_KEY)
    unreadable = RecordingServer({"/health": Route(200), "/v1/models": Route(200, GARBAGE, JSON)})
    comeback = sim_proc(tmp_path, "--api-key", UPSTREAM, port=down_port)
    with unreadable:
        engines = [down, wrong_key.url, unreadable.url, silent.url]
        env = {
            "GATEWAY_ENGINES": json.dumps(engines),
            "GATEWAY_API_KEYS": json.dumps([{"key": ADMIN, "name": "ops", "scopes": ["admin"]}]),
            "GATEWAY_UPSTREAM_API_KEY": UPSTREAM,
            "GATEWAY_ROUTING__HEALTH_TIMEOUT": "0.5",
            "GATEWAY_ROUTING__HEALTH_INTERVAL": "0.3",
        }
        gateway = gateway_proc(tmp_path, env)
        try:
            wrong_key.start()
            gateway.start("/healthz")
            # Many checks ran (every 0.25 s while none is ready, each round bounded by
            # the 0.5 s timeout): still one line per engine.
            checks = lambda: sum(h.path == "/health" for h in unreadable.hits)  # noqa: E731
            assert wait_for(lambda: checks() >= 6, timeout=20), gateway.log_tail()
            expected = {
                down: ["connect_refused"],
                wrong_key.url: ["upstream_key_refused"],
                unreadable.url: ["models_unreadable"],
                silent.url: ["timeout"],
            }
            assert reasons_by_engine(gateway) == expected
            lines = {line["engine"]: line for line in health_lines(gateway)}
            assert lines[wrong_key.url]["level"] == "warning"
            assert "upstream_api_key is not the key" in lines[wrong_key.url]["detail"]
            assert "not JSON" in lines[unreadable.url]["detail"]

            # The start line has each engine's state after the first checks.
            (serving,) = [
                json.loads(raw) for raw in gateway.log().splitlines() if '"gateway_serving"' in raw
            ]
            assert [(s["engine"], s["healthy"], s["reason"]) for s in serving["engine_states"]] == [
                (url, False, reasons[0]) for url, reasons in expected.items()
            ]

            # /readyz: states and reasons by index, no address.
            r = HTTP.get(gateway.url + "/readyz")
            assert r.status_code == 503
            ready = r.json()
            assert (ready["status"], ready["healthy_engines"], ready["engines"]) == (
                "no_healthy_engine",
                0,
                4,
            )
            assert ready["engine_states"] == [
                {"index": i, "healthy": False, "reason": reasons[0]}
                for i, reasons in enumerate(expected.values())
            ]
            assert "127.0.0.1" not in r.text and str(down_port) not in r.text

            # /gateway/status: the URL, the reason and its detail.
            engines_status = status(gateway)["engines"]
            assert [(e["url"], e["healthy"], e["reason"]) for e in engines_status] == [
                (url, False, reasons[0]) for url, reasons in expected.items()
            ]
            assert "answered 401" in engines_status[1]["detail"]
            assert "0.5 s" in engines_status[3]["detail"]
            assert_no_secret(r.text, json.dumps(engines_status))

            # Recovery: the model list turns readable, the engine comes back.
            unreadable.routes["/v1/models"] = Route(200, MODELS_BODY, JSON)
            assert wait_for(lambda: HTTP.get(gateway.url + "/readyz").status_code == 200)
            comeback.start()
            assert wait_for(lambda: status(gateway)["engines"][0]["healthy"], timeout=10)
            settled = checks()
            assert wait_for(lambda: checks() >= settled + 4, timeout=20)
            expected[down].append(None)
            expected[unreadable.url].append(None)
            assert reasons_by_engine(gateway) == expected
            back = [line for line in health_lines(gateway) if line["reason"] is None]
            assert all(line["healthy"] is True and line["level"] == "info" for line in back)
            r = HTTP.get(gateway.url + "/readyz")
            assert [s["reason"] for s in r.json()["engine_states"]] == [
                None,
                "upstream_key_refused",
                None,
                "timeout",
            ]
            engines_status = status(gateway)["engines"]
            assert engines_status[2]["reason"] is None and engines_status[2]["detail"] is None
            assert engines_status[2]["models"] == [MODEL]
        finally:
            gateway.stop()
            comeback.stop()
            wrong_key.stop()
    assert_no_secret(gateway.log())


@pytest.mark.slow
def test_an_engine_that_needs_a_key_the_gateway_does_not_send(tmp_path: Path) -> None:
    sim = sim_proc(tmp_path, "--api-key", ENGINE_KEY)
    env = {
        # (An engine URL with credentials is refused at start: test_config_errors.)
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps([{"key": ADMIN, "name": "ops", "scopes": ["admin"]}]),
        "GATEWAY_PUBLIC_METRICS": "true",
    }
    gateway = gateway_proc(tmp_path, env)
    try:
        sim.start()
        gateway.start("/healthz")
        assert wait_for(lambda: len(health_lines(gateway)) == 1, timeout=10)
        (engine,) = status(gateway)["engines"]
        assert engine["url"] == sim.url and engine["reason"] == "upstream_key_refused"
        assert "upstream_api_key is not set" in engine["detail"]
        (line,) = health_lines(gateway)
        assert (line["engine"], line["reason"]) == (sim.url, "upstream_key_refused")
        assert metric(gateway.url, "gateway_engine_healthy", engine=sim.url) == 0
    finally:
        gateway.stop()
        sim.stop()
    assert_no_secret(gateway.log())


# --- an engine busy with a large body ---------------------------------------------------


def _slow_lines(gateway: Proc) -> list[dict[str, Any]]:
    return health_lines(gateway, "engine_health_slow")


SMALL_CHAT = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def _held_chat(pool: ThreadPoolExecutor, gateway: Proc, key: str, mib: int) -> Future[int]:
    """Posts a chat with `mib` MiB of filler (the engine holds its loop for it) from
    `pool`; the future's result is the answer's status."""
    body = json.dumps({**SMALL_CHAT, "metadata_filler": "x" * (mib << 20)}).encode()
    url, headers = gateway.url + "/v1/chat/completions", {**auth(key), **JSON}
    return pool.submit(
        lambda: HTTP.post(url, content=body, headers=headers, timeout=60).status_code
    )


@contextmanager
def _busy_stack(
    tmp_path: Path, hold_per_mib: str, *others: Proc, **env: str
) -> Iterator[tuple[Proc, Proc]]:
    """A simulated engine that holds its event loop `hold_per_mib` s per MiB of body (as
    vLLM's server does parsing one), and a gateway checking it (and `others`, started
    by the caller, listed after it) every 0.1 s within 0.2 s."""
    sim = sim_proc(tmp_path, "--latency", "zero", "--loop-hold-per-mib", hold_per_mib)
    gateway = gateway_proc(
        tmp_path,
        {
            "GATEWAY_ENGINES": json.dumps([sim.url, *(o.url for o in others)]),
            # The first engine takes each request while it is in rotation.
            "GATEWAY_ROUTING__POLICY": "least_loaded",
            "GATEWAY_API_KEYS": json.dumps([ADMIN, UPSTREAM]),
            "GATEWAY_ROUTING__HEALTH_INTERVAL": "0.1",
            "GATEWAY_ROUTING__HEALTH_TIMEOUT": "0.2",
            **env,
        },
    )
    with running(sim), running(gateway, ready_path="/readyz"):
        yield sim, gateway


@pytest.mark.slow
def test_an_engine_busy_with_our_request_stays_in_rotation_while_it_misses_checks(
    tmp_path: Path,
) -> None:
    """The engine holds its loop 3 s for a 2 MiB body: its checks time out meanwhile,
    but a request of ours is in flight, so it stays in rotation (busy_grace, 10 s by
    default) and another key's request sent then is served, not refused 503."""
    with _busy_stack(tmp_path, "1.5") as (sim, gateway), ThreadPoolExecutor(1) as pool:
        before = sim_received(sim.url)
        big = _held_chat(pool, gateway, ADMIN, 2)
        assert wait_for(lambda: _slow_lines(gateway), timeout=20), gateway.log_tail()
        assert HTTP.get(gateway.url + "/readyz").status_code == 200
        url = gateway.url + "/v1/chat/completions"
        small = HTTP.post(url, json=SMALL_CHAT, headers=auth(UPSTREAM), timeout=30)
        assert small.status_code == 200, small.text
        assert big.result(30) == 200
        assert sim_received(sim.url) == before + 2
        assert not [line for line in health_lines(gateway) if not line["healthy"]]
        (slow,) = _slow_lines(gateway)
        assert slow["in_flight"] == 1 and "0.2 s" in slow["detail"]


@pytest.mark.slow
def test_an_engine_still_timing_out_after_its_grace_is_taken_out(tmp_path: Path) -> None:
    """With busy_grace 0.5 s and a 3 s hold, the engine is taken out (reason timeout)
    while the request is still in flight, and comes back once it answers checks again;
    the request in flight is answered. Another engine serves its model: the last one
    would stay while it answers (tests/e2e/test_engine_blame.py)."""
    grace = {"GATEWAY_ROUTING__BUSY_GRACE": "0.5"}
    spare = sim_proc(tmp_path, "--latency", "zero")
    with (
        running(spare),
        _busy_stack(tmp_path, "3", spare, **grace) as (sim, gateway),
        ThreadPoolExecutor(1) as pool,
    ):
        lines = lambda: [x for x in health_lines(gateway) if x["engine"] == sim.url]  # noqa: E731
        big = _held_chat(pool, gateway, ADMIN, 1)
        out = lambda: [line for line in lines() if not line["healthy"]]  # noqa: E731
        assert wait_for(out, timeout=20), gateway.log_tail()
        assert [line["reason"] for line in out()] == ["timeout"]
        assert not big.done()  # taken out while the request was in flight
        assert len(_slow_lines(gateway)) == 1
        assert big.result(30) == 200
        assert wait_for(lambda: len(lines()) == 3, timeout=20)
        # Healthy at start, out, back.
        assert [line["healthy"] for line in lines()] == [True, False, True]
        spare_out = [x for x in health_lines(gateway) if x["engine"] == spare.url]
        assert all(x["healthy"] for x in spare_out)
