"""The engine pool: DNS entries, passive ejection and back-off, readiness, scraped load.

Its tables run in tests/unit/routing/; the pool's loops run in-process against real
simulated engines (only the DNS resolver is swapped, to change the answers); the rest
runs the real gateway in front of real engines and recording servers on loopback.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from bench.harness.metrics import HTTP
from bench.harness.origin import RecordingServer, Route
from bench.sim.config import DEFAULT_MODEL as MODEL
from gateway.routing.dns import NameNotFound
from gateway.routing.pool import EnginePool
from gateway.routing.settings import RoutingSettings
from gateway.upstream.client import Upstream
from tests.procs import Proc, gateway_proc, scrape, sim_proc, wait_for

KEY = "sk-routing-pool-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {KEY}"}
OTHER_KEY = "sk-routing-pool-other-0123456789abcdef"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MODELS_BODY = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
CHAT_BODY = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()
JSON = {"Content-Type": "application/json"}

# --- tables ------------------------------------------------------------------------------


# --- the pool's loops against real engines ------------------------------------------------


def _upstream(kind: type[Upstream] = Upstream) -> Upstream:
    """The client the gateway checks engines with (the one it forwards with)."""
    return kind(connect_timeout=1.0, first_byte_timeout=5.0, keepalive=4.0)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = sim_proc(tmp_path_factory.mktemp("pool-sim"), "--latency", "zero").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.slow
async def test_dns_entry_follows_the_answers(sim: Proc) -> None:
    answers: list[str] | Exception = ["127.0.0.1"]

    async def resolver(host: str, port: int) -> Sequence[str]:
        assert (host, port) == ("engines.test", sim.port)
        if isinstance(answers, Exception):
            raise answers
        return answers

    settings = RoutingSettings(health_interval=0.05, dns_interval=0.05, health_timeout=0.5)
    upstream = _upstream()
    pool = EnginePool(
        [f"dns+http://engines.test:{sim.port}"], settings, upstream=upstream, resolver=resolver
    )
    urls = lambda: sorted(e.url for e in pool.engines)  # noqa: E731
    healthy = lambda: sorted(e.url for e in pool.healthy())  # noqa: E731
    await pool.start()
    try:
        assert urls() == healthy() == [sim.url] and pool.ready()
        assert pool.index.engines(MODEL) == tuple(pool.engines)
        # A second address appears; nothing listens there, so it is listed, unhealthy.
        answers = ["127.0.0.1", "127.0.0.2"]
        await _until(lambda: len(urls()) == 2)
        await asyncio.sleep(0.2)
        assert healthy() == [sim.url]
        # A failed lookup keeps the engines; a name with no addresses empties the entry.
        (spec,) = pool.dns_reasons
        assert pool.dns_reasons[spec] is None
        answers = OSError("resolver timeout")
        await asyncio.sleep(0.2)
        assert len(urls()) == 2
        assert getattr(pool.dns_reasons[spec], "reason", None) == "dns_failed"
        answers = NameNotFound("engines.test")
        await _until(lambda: not urls())
        assert not pool.ready()
        assert getattr(pool.dns_reasons[spec], "reason", None) == "dns_no_addresses"
        answers = ["127.0.0.1"]
        await _until(lambda: healthy() == [sim.url])
        assert pool.dns_reasons[spec] is None
    finally:
        await pool.stop()
        await upstream.aclose()


@pytest.mark.slow
async def test_background_loops_outlive_an_unexpected_failure(sim: Proc) -> None:
    """A resolver and a client that raise what they should not (a bug, not an engine's
    answer): the round is logged and the next one runs; the loops do not end."""
    failing = True
    answers = ["127.0.0.1"]

    async def resolver(host: str, port: int) -> Sequence[str]:
        if failing:
            raise RuntimeError("resolver bug")
        return answers

    class FailingUpstream(Upstream):
        async def request(self, *args: Any, **kwargs: Any) -> Any:
            if failing:
                raise RuntimeError("client bug")
            return await super().request(*args, **kwargs)

    settings = RoutingSettings(
        health_interval=0.05, dns_interval=0.05, eject_backoff=0.1, eject_backoff_max=0.1
    )
    upstream = _upstream(FailingUpstream)
    pool = EnginePool(
        [sim.url, f"dns+http://engines.test:{sim.port}"],
        settings,
        upstream=upstream,
        resolver=resolver,
    )
    with capture_logs() as logs:
        with pytest.raises(RuntimeError):
            await pool.start()  # the first rounds run in start(): a failure there is loud
        failing = False
        await pool.start()
        try:
            direct = next(e for e in pool.engines if e.url == sim.url)
            assert direct.healthy
            failing = True
            failed = lambda: {e["loop"] for e in logs if e["event"] == "engine_loop_failed"}  # noqa: E731
            await _until(lambda: failed() == {"engine-health", "engine-dns"})
            await asyncio.sleep(0.2)  # more rounds of each loop fail
            failing = False
            # The health loop still runs: an ejected engine comes back after its back-off.
            pool.eject(direct)
            await _until(lambda: direct.healthy)
            # The DNS loop still runs: a new address is picked up.
            answers = ["127.0.0.1", "127.0.0.2"]
            await _until(lambda: len(pool.engines) == 3)
        finally:
            await pool.stop()
            await upstream.aclose()


async def _until(predicate: object, within: float = 5.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_ejection_backs_off_then_recovers_on_a_good_check(sim: Proc) -> None:
    settings = RoutingSettings(
        health_interval=0.05, eject_backoff=0.3, eject_backoff_max=0.6, eject_after_5xx=3
    )
    upstream = _upstream()
    pool = EnginePool([sim.url], settings, upstream=upstream)
    await pool.start()
    try:
        (engine,) = pool.engines
        assert engine.healthy
        pool.eject(engine)
        assert pool.healthy() == [] and engine.backoff == 0.3 and engine.ejections == 1
        assert engine.reason == "ejected_connect" and "back-off 0.3 s" in str(engine.detail)
        # The engine answers its health checks, but stays out for its back-off.
        started = time.monotonic()
        await _until(lambda: engine.healthy)
        assert time.monotonic() - started >= 0.25
        assert (engine.reason, engine.detail) == (None, None)
        # Ejected again without a good answer in between: the back-off doubles, capped.
        pool.eject(engine)
        assert engine.backoff == 0.6
        await _until(lambda: engine.healthy)
        pool.eject(engine)
        assert engine.backoff == 0.6 and engine.ejections == 3
        await _until(lambda: engine.healthy)
        # A good answer ends the back-off; a run of 5xx (not a single one) ejects.
        pool.succeeded(engine)
        pool.failed(engine, "a", 500)
        pool.failed(engine, "b", 500)
        assert engine.healthy
        pool.failed(engine, "a", 500)
        assert not engine.healthy and engine.backoff == 0.3
        assert (engine.reason, engine.detail) == (
            "ejected_5xx",
            "3 5xx answers in a row; back-off 0.3 s",
        )
    finally:
        await pool.stop()
        await upstream.aclose()


# --- the real gateway ------------------------------------------------------------------


def _gateway(tmp: Path, engines: Sequence[str], **env: str) -> Proc:
    settings = {
        "GATEWAY_ENGINES": json.dumps(list(engines)),
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_PUBLIC_METRICS": "true",
        **env,
    }
    return gateway_proc(tmp, settings).start("/healthz")


@pytest.mark.slow
def test_gateway_resolves_a_dns_entry_to_its_addresses(sim: Proc, tmp_path: Path) -> None:
    # localhost resolves to 127.0.0.1 and, on most hosts, ::1; the engine listens on the
    # first only, so only that address turns healthy.
    gw = _gateway(tmp_path, [f"dns+http://localhost:{sim.port}"])
    try:
        ready = HTTP.get(gw.url + "/readyz").json()
        assert ready["status"] == "ready" and ready["healthy_engines"] == 1
        assert ready["engines"] >= 1
        r = HTTP.post(gw.url + "/v1/chat/completions", headers=HEADERS, json=CHAT, timeout=10)
        assert r.status_code == 200, r.text
        samples = scrape(gw.url + "/metrics")
        assert samples[("gateway_engine_healthy", (("engine", sim.url),))] == 1
        v6 = ("gateway_engine_healthy", (("engine", f"http://[::1]:{sim.port}"),))
        assert samples.get(v6, 0) == 0
    finally:
        gw.stop()


@pytest.mark.slow
def test_not_ready_until_the_engine_lists_its_models(tmp_path: Path) -> None:
    # The engine answers /health but not /v1/models (as one still starting, or a slow
    # listing): the gateway must not refuse the model as unknown, nor forward anything.
    routes = {"/health": Route(200), "/v1/models": Route(503)}
    with RecordingServer(routes) as engine:
        gw = _gateway(tmp_path, [engine.url], GATEWAY_ROUTING__HEALTH_INTERVAL="30")
        try:
            r = HTTP.get(gw.url + "/readyz")
            assert (r.status_code, r.json()["status"]) == (503, "no_healthy_engine")
            r = HTTP.post(gw.url + "/v1/chat/completions", headers=HEADERS, json=CHAT)
            assert (r.status_code, r.json()["error"]["code"]) == (503, "no_engine_available")
            assert not [h for h in engine.hits if h.path == "/v1/chat/completions"]
            # The listing works now: ready within the fast not-ready interval, not 30 s.
            engine.routes["/v1/models"] = Route(200, MODELS_BODY, JSON)
            engine.routes["/v1/chat/completions"] = Route(200, CHAT_BODY, JSON)
            ok = lambda: HTTP.get(gw.url + "/readyz").status_code == 200  # noqa: E731
            assert wait_for(ok, timeout=3)
            r = HTTP.post(gw.url + "/v1/chat/completions", headers=HEADERS, json=CHAT)
            assert r.status_code == 200
            assert [h for h in engine.hits if h.path == "/v1/chat/completions"]
        finally:
            gw.stop()


@pytest.mark.slow
def test_a_run_of_5xx_ejects_the_engine(sim: Proc, tmp_path: Path) -> None:
    routes = {
        "/health": Route(200),
        "/v1/models": Route(200, MODELS_BODY, JSON),
        "/v1/chat/completions": Route(500, b'{"error": "boom"}', JSON),
    }
    with RecordingServer(routes) as bad:
        gw = _gateway(
            tmp_path,
            [sim.url, bad.url],
            GATEWAY_ROUTING__POLICY="round_robin",
            GATEWAY_ROUTING__EJECT_BACKOFF="60",
            GATEWAY_API_KEYS=json.dumps([KEY, OTHER_KEY]),
        )
        try:
            # Two keys take turns: the run of 5xx spans both (one key's alone would not
            # eject: tests/e2e/test_engine_blame.py).
            keys = [HEADERS, {"Authorization": f"Bearer {OTHER_KEY}"}]
            with httpx.Client(timeout=10) as client:
                statuses = [
                    client.post(
                        gw.url + "/v1/chat/completions", headers=keys[i // 2 % 2], json=CHAT
                    ).status_code
                    for i in range(20)
                ]
            # The engine's own 500s pass through until the fifth in a row ejects it.
            assert statuses.count(500) == 5 and statuses.count(200) == 15, statuses
            assert len([h for h in bad.hits if h.path == "/v1/chat/completions"]) == 5
            samples = scrape(gw.url + "/metrics")
            assert samples[("gateway_engine_ejections_total", (("engine", bad.url),))] == 1
            assert samples[("gateway_engine_healthy", (("engine", bad.url),))] == 0
            assert wait_for(
                lambda: '"reason":"ejected_5xx"' in gw.log().replace(" ", ""), timeout=5
            )
        finally:
            gw.stop()


@pytest.mark.slow
def test_scraped_queue_steers_least_loaded(tmp_path: Path) -> None:
    # Engine A runs one request at a time and is kept busy by another client (as by
    # another gateway replica): this gateway has nothing in flight there, but sees A's
    # queue in its /metrics and sends its own requests to B.
    a = sim_proc(tmp_path, "--max-num-seqs", "1").start()
    b = sim_proc(tmp_path, "--latency", "zero").start()
    gw = _gateway(
        tmp_path,
        [a.url, b.url],
        GATEWAY_ROUTING__POLICY="least_loaded",
        GATEWAY_ROUTING__LOAD_INTERVAL="0.05",
    )
    slow = {**CHAT, "max_tokens": 30, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(6) as pool:
            busy = [
                pool.submit(httpx.post, a.url + "/v1/chat/completions", json=slow, timeout=20)
                for _ in range(6)
            ]
            waiting = ("gateway_engine_waiting", (("engine", a.url),))
            assert wait_for(lambda: scrape(gw.url + "/metrics").get(waiting, 0) >= 2, timeout=5)
            # All six reached A (the queue can show before the last one has arrived).
            assert wait_for(lambda: _received(a) >= 6, timeout=10)
            before = _received(a)
            with httpx.Client(timeout=10) as client:
                for _ in range(8):
                    r = client.post(gw.url + "/v1/chat/completions", headers=HEADERS, json=CHAT)
                    assert r.status_code == 200
            assert _received(a) == before
            assert all(f.result().status_code == 200 for f in busy)
        kv = ("gateway_engine_kv_cache_usage", (("engine", b.url),))
        assert kv in scrape(gw.url + "/metrics")
    finally:
        for proc in (gw, a, b):
            proc.stop()


def _received(sim: Proc) -> float:
    samples = scrape(sim.url + "/metrics")
    key = ("sim:received_requests_total", (("path", "/v1/chat/completions"),))
    return samples.get(key, 0.0)
