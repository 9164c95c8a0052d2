"""Failover through the real gateway in front of three real simulated engines.

The engines run with calibrated latency and `--max-num-seqs 1`, so requests take tens
of milliseconds and queue in an engine: a killed engine has requests in flight, and a
hot anchor builds a queue the load bound must spill. Where a request went is read from
the engines' request recorders (by `X-Request-Id`), never from the gateway.

Two gateways front the same engines: `fast` checks health every 0.2 s with a 0.2 s
ejection back-off (an engine comes back soon after it recovers); `slow` checks every
300 s, so only refused connections (passive checks) take an engine out of its rotation.
The tests run in file order: the later ones kill engines for good.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    client_request_id,
    gateway_proc,
    metric,
    sim_proc,
    sim_received,
    wait_for,
)

KEY = "sk-routing-failover-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {KEY}"}
SIM_OPTS = ("--max-num-seqs", "1", "--record-requests", "2000")


@dataclass
class Stack:
    tmp: Path
    sims: list[Proc]
    fast: Proc
    slow: Proc


def _gateway(tmp: Path, engines: Sequence[str], **env: str) -> Proc:
    settings = {
        "GATEWAY_ENGINES": json.dumps(list(engines)),
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_PUBLIC_METRICS": "true",
        "GATEWAY_TIMEOUTS__FIRST_BYTE": "10",
        **env,
    }
    return gateway_proc(tmp, settings)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("failover")
    sims = [sim_proc(tmp, *SIM_OPTS) for _ in range(3)]
    urls = [s.url for s in sims]
    fast = _gateway(
        tmp,
        urls,
        # A tighter bound than the default (2), so 12 requests on one anchor spill.
        GATEWAY_ROUTING__LOAD_EPSILON="0.75",
        GATEWAY_ROUTING__HEALTH_INTERVAL="0.2",
        GATEWAY_ROUTING__HEALTH_TIMEOUT="0.5",
        GATEWAY_ROUTING__EJECT_BACKOFF="0.2",
    )
    slow = _gateway(tmp, urls, GATEWAY_ROUTING__HEALTH_INTERVAL="300")
    started: list[Proc] = []
    try:
        for proc in [*sims, fast, slow]:
            proc.start("/health" if proc in sims else "/healthz")
            started.append(proc)
        for gw in (fast, slow):
            ready = lambda gw=gw: HTTP.get(gw.url + "/readyz").json()["healthy_engines"] == 3  # noqa: E731
            assert wait_for(ready, timeout=15), gw.log()
        yield Stack(tmp, sims, fast, slow)
    finally:
        for proc in reversed(started):
            proc.stop()
        for sim in sims:  # restarted ones are new processes on the same Proc
            sim.stop()


def chat(text: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def recorded(sim: Proc) -> list[str]:
    """Ids of the chat requests `sim` received, from its recorder."""
    entries = HTTP.get(sim.url + "/sim/requests", timeout=5).json()
    return [
        client_request_id(e["headers"]["x-request-id"])
        for e in entries
        if e["path"] == "/v1/chat/completions" and "x-request-id" in e["headers"]
    ]


def served(sims: Sequence[Proc], snapshots: dict[int, list[str]] | None = None) -> dict[str, int]:
    """Request id -> index of the engine that received it (asserting it was one). A dead
    engine's recorder is gone: `snapshots` gives what it had received before."""
    out: dict[str, int] = {}
    for index, sim in enumerate(sims):
        ids = recorded(sim) if sim.alive() else (snapshots or {}).get(index, [])
        for request_id in ids:
            assert request_id not in out, f"{request_id} reached two engines"
            out[request_id] = index
    return out


def request_lines(gateway: Proc, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The request log lines of `ids` (a line is written just after its response)."""
    out: dict[str, dict[str, Any]] = {}

    def read() -> bool:
        lines = [json.loads(x) for x in gateway.log().splitlines() if x.startswith("{")]
        out.update((x["request_id"], x) for x in lines if x.get("event") == "request")
        return all(i in out for i in ids)

    assert wait_for(read, timeout=5), [i for i in ids if i not in out]
    return out


# --- a hot anchor spills (before any engine is killed) -----------------------------------


@pytest.mark.slow
def test_hot_anchor_spills_to_the_next_engine(stack: Stack) -> None:
    # Twelve requests with one anchor at once; each takes ~340 ms on an engine that runs
    # one at a time, long enough that all twelve arrive before the first ends, even on a
    # loaded machine (at ~150 ms, early ones ended and freed room for a ninth). Without
    # the bound they would all queue on the anchor's engine.
    body = chat("Summarise the quarterly report, please.", max_tokens=40)
    ids = [f"hot-{i}" for i in range(12)]
    in_flight_seen: list[float] = []

    def send(request_id: str) -> int:
        r = HTTP.post(
            stack.fast.url + "/v1/chat/completions",
            json=body,
            headers={**HEADERS, "X-Request-Id": request_id},
            timeout=20,
        )
        return r.status_code

    def watch() -> bool:
        in_flight_seen.append(metric(stack.fast.url, "gateway_engine_in_flight"))
        return in_flight_seen[-1] >= 1

    spilled_before = metric(stack.fast.url, "gateway_routing_decisions_total", policy="affinity",
                            choice="spilled")  # fmt: skip
    with ThreadPoolExecutor(len(ids)) as pool:
        futures = [pool.submit(send, i) for i in ids]
        # Seen while they run (twelve at ~340 ms, one at a time an engine: seconds).
        wait_for(watch, timeout=15, interval=0.02)
        statuses = [f.result() for f in futures]
    assert statuses == [200] * len(ids)
    where = served(stack.sims)
    engines = [where[i] for i in ids]
    assert len(set(engines)) >= 2, engines
    # Never all on one engine, and the bound keeps the anchor's engine near its share.
    assert max(engines.count(e) for e in set(engines)) <= 8, engines
    assert max(in_flight_seen) >= 1  # the per-engine gauge saw the requests in flight
    spilled = metric(stack.fast.url, "gateway_routing_decisions_total", policy="affinity",
                     choice="spilled")  # fmt: skip
    assert spilled - spilled_before >= 1
    lines = request_lines(stack.fast, ids)
    assert all(lines[i]["policy"] == "affinity" for i in ids)
    assert {lines[i]["anchor_kind"] for i in ids} == {"first_user"}
    first_engine = {lines[i]["engine"] for i in ids if lines[i]["spilled"] is False}
    spilled_engines = {lines[i]["engine"] for i in ids if lines[i]["spilled"] is True}
    assert len(first_engine) == 1 and spilled_engines and not first_engine & spilled_engines


# --- an engine killed mid-run, then restarted ------------------------------------------


@dataclass
class Outcome:
    request_id: str
    started: float
    ended: float
    status: int
    # "ok": a complete answer; "error": a clear gateway error (502/504 JSON, or an SSE
    # error frame after a 200); anything else fails the test.
    kind: str
    code: str | None = None


def _one(client: httpx.Client, gateway: Proc, request_id: str, stream: bool) -> Outcome:
    started = time.monotonic()
    headers = {**HEADERS, "X-Request-Id": request_id}
    body = chat(f"Request {request_id}: plan my week.", stream=stream)
    url = gateway.url + "/v1/chat/completions"
    if not stream:
        r = client.post(url, json=body, headers=headers)
        ended = time.monotonic()
        if r.status_code == 200:
            kind = "ok" if r.json()["choices"][0]["message"]["content"] else "bad"
            return Outcome(request_id, started, ended, 200, kind)
        code = r.json()["error"]["code"]
        kind = "error" if r.status_code in (502, 504) and code.startswith("upstream_") else "bad"
        return Outcome(request_id, started, ended, r.status_code, kind, code)
    with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            code = r.json()["error"]["code"]
            ok = r.status_code in (502, 504) and code.startswith("upstream_")
            return Outcome(request_id, started, time.monotonic(), r.status_code,
                           "error" if ok else "bad", code)  # fmt: skip
        frames = [line for line in r.iter_lines() if line]
    ended = time.monotonic()
    if frames and frames[-1] == "data: [DONE]":
        return Outcome(request_id, started, ended, 200, "ok")
    last = json.loads(frames[-1][len("data: ") :]) if frames else {}
    code = last.get("error", {}).get("code")
    return Outcome(request_id, started, ended, 200, "error" if code else "bad", code)


# Requests answered before the kill: enough that unique prompts reached all three engines.
BEFORE = 24


@pytest.mark.slow
def test_killed_engine_loses_no_request_that_had_not_started(stack: Stack) -> None:
    victim = stack.sims[1]
    outcomes: list[Outcome] = []
    stop = threading.Event()
    lock = threading.Lock()

    def worker(w: int) -> None:
        with httpx.Client(timeout=10) as client:
            n = 0
            while not stop.is_set():
                outcome = _one(client, stack.fast, f"kill-{w}-{n}", stream=(w + n) % 2 == 0)
                with lock:
                    outcomes.append(outcome)
                n += 1

    def ended(since: float = 0.0) -> int:
        with lock:
            return sum(o.started > since for o in outcomes)

    # Counts of requests, not spans of time: a loaded machine fits fewer in a second.
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(worker, w) for w in range(4)]
        assert wait_for(lambda: ended() >= BEFORE, timeout=30), len(outcomes)
        # What the victim recorded so far (its recorder dies with it); requests it gets
        # from here to the kill are left out of the checks that use it.
        snapshot = recorded(victim)
        # Kill right after seeing a request in flight there: with nothing between the
        # two, that request (tens of ms long) is still running when the kill lands, even
        # on a loaded machine.
        busy = lambda: HTTP.get(victim.url + "/load").json()["server_load"] > 0  # noqa: E731
        assert wait_for(busy, timeout=5, interval=0.005)
        kill_started = time.monotonic()
        victim.kill()
        kill_done = time.monotonic()
        assert wait_for(lambda: ended(kill_done) >= 8, timeout=30), len(outcomes)
        stop.set()
        for f in futures:
            f.result()  # a hang would raise httpx's timeout here

    before = [o for o in outcomes if o.ended < kill_started]
    during = [o for o in outcomes if o.started <= kill_done and o.ended >= kill_started]
    after = [o for o in outcomes if o.started > kill_done]
    assert len(before) >= 8 and len(after) >= 8, (len(before), len(after))
    assert all(o.kind == "ok" for o in before + after), [
        o for o in before + after if o.kind != "ok"
    ]
    assert all(o.kind in ("ok", "error") for o in during), during
    # The victim was killed with a request in flight: that one got a clear error.
    assert any(o.kind == "error" for o in during), during
    # Also asserts that no request reached two engines (none was retried after the
    # victim received it, as far as its recorder saw before the kill).
    where = served(stack.sims, {1: snapshot})
    assert {where[o.request_id] for o in before if o.request_id in where} == {0, 1, 2}
    assert all(where[o.request_id] in (0, 2) for o in after)
    healthy = metric(stack.fast.url, "gateway_engine_healthy", engine=victim.url)
    assert healthy == 0


@pytest.mark.slow
def test_restarted_engine_comes_back_into_rotation(stack: Stack) -> None:
    victim = stack.sims[1]
    assert not victim.alive()
    restarted = sim_proc(stack.tmp, *SIM_OPTS, port=victim.port).start()
    victim.popen = restarted.popen  # the module's teardown stops it
    assert wait_for(
        lambda: metric(stack.fast.url, "gateway_engine_healthy", engine=victim.url) == 1, timeout=10
    ), stack.fast.log()
    with httpx.Client(timeout=10) as client:
        for i in range(30):
            r = client.post(stack.fast.url + "/v1/chat/completions", headers=HEADERS,
                            json=chat(f"Back again {i}: what is new?"))  # fmt: skip
            assert r.status_code == 200, r.text
    assert sim_received(victim.url) >= 3


# --- refused connections: failover once per engine (kills engines for good) -------------


@pytest.mark.slow
def test_refused_connections_fail_over_once_per_engine(stack: Stack) -> None:
    # `slow` saw every engine healthy at its one check so far (at start) and forwarded
    # nothing yet: only refused connections can take engines out of its rotation.
    assert HTTP.get(stack.slow.url + "/readyz").json()["healthy_engines"] == 3
    stack.sims[1].kill()
    stack.sims[2].kill()
    ids = [f"refused-{i}" for i in range(12)]
    with httpx.Client(timeout=10) as client:
        for request_id in ids:
            r = client.post(
                stack.slow.url + "/v1/chat/completions",
                headers={**HEADERS, "X-Request-Id": request_id},
                json=chat(f"{request_id}: where is my parcel?"),
            )
            assert r.status_code == 200, r.text
    where = served(stack.sims)
    assert all(where[i] == 0 for i in ids)
    lines = request_lines(stack.slow, ids)
    failovers = [lines[i]["failovers"] for i in ids]
    # Each dead engine refuses one request, is ejected, and is not tried again.
    assert sum(failovers) == 2 and max(failovers) <= 2, failovers
    assert metric(stack.slow.url, "gateway_routing_failovers_total") == 2
    assert HTTP.get(stack.slow.url + "/readyz").json()["healthy_engines"] == 1
    for dead in stack.sims[1:]:
        assert metric(stack.slow.url, "gateway_engine_ejections_total", engine=dead.url) == 1

    # The last one dies: it refuses its request (a clear 502) and is ejected. With no
    # engine of the model in rotation nothing is tried: 503, "retry shortly".
    stack.sims[0].kill()
    for request_id, status, code in (
        ("last-dead", 502, "upstream_unavailable"),
        ("all-dead", 503, "model_unavailable"),
    ):
        r = HTTP.post(
            stack.slow.url + "/v1/chat/completions",
            headers={**HEADERS, "X-Request-Id": request_id},
            json=chat("Anyone there?"),
            timeout=10,
        )
        assert (r.status_code, r.json()["error"]["code"]) == (status, code)
        assert request_lines(stack.slow, [request_id])[request_id]["failovers"] == 0
    assert metric(stack.slow.url, "gateway_engine_ejections_total", engine=stack.sims[0].url) == 1
    assert HTTP.get(stack.slow.url + "/readyz").status_code == 503
