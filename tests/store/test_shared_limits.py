"""A key's limits held across workers and replicas through the shared store: real
processes, redis-server, one simulated engine, two gateway replicas of two workers each
(`serve --workers 2`), one replica with `limits.*_when_store_down: local`, the other with
`refuse`.

What reached the engine is read from the engine's own counters, never from the gateway.
Each test uses keys of its own, so the buckets and leases of one do not spill into
another. Marked `redis` (scripts/test-store.sh).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_client
from prometheus_client.parser import text_string_to_metric_families

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

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# A generation that streams for a long while: it holds its slot until closed.
LONG = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
# The example: 4 per second, a burst of 4.
FAST = {"requests_per_second": 4, "burst": 4}
# A token every 20 s: within a test, a key has its burst and nothing more.
SLOW = {"requests_per_second": 0.05, "burst": 2}
CAP = 3
# Short enough for the tests to move on, long enough that a loaded machine's Redis
# answers in time (a slow answer would fall back to per-process limits).
TIMEOUT = "1.0"
RETRY = "0.5"


# Failed authentications per client address and window: the default count, and a long
# window so that one test's failures fall into one.
AUTH_FAILURES = 20
AUTH_WINDOW = 3600


def key(name: str) -> str:
    return f"sk-shared-{name}-0123456789abcdef"


KEYS: list[dict[str, Any]] = [
    {"key": key("plain"), "name": "plain"},
    {"key": key("rated"), "name": "rated", "rate": FAST},
    {"key": key("probe"), "name": "probe", "rate": {"requests_per_second": 1000, "burst": 1000}},
    {"key": key("capped"), "name": "capped", "max_in_flight": CAP},
    *({"key": key(f"slow-{n}"), "name": f"slow-{n}", "rate": SLOW} for n in range(4)),
    {"key": key("capped-down"), "name": "capped-down", "max_in_flight": CAP},
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-limits")


@pytest.fixture(scope="module")
def store(tmp: Path) -> Iterator[RedisServer]:
    with RedisServer(free_port(), tmp / "redis.log") as server:
        yield server


@pytest.fixture(scope="module")
def sim(tmp: Path) -> Iterator[Proc]:
    with running(sim_proc(tmp)) as (engine,):
        yield engine


@pytest.fixture(scope="module")
def replicas(tmp: Path, store: RedisServer, sim: Proc) -> Iterator[tuple[Proc, Proc]]:
    """(local, refuse): the same keys and store, two workers each."""
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    base = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(KEYS),
        "GATEWAY_PUBLIC_METRICS": "true",
        "GATEWAY_STORE_URL": store.url,
        "GATEWAY_STORE_PREFIX": prefix,
        "GATEWAY_STORE_TIMEOUT": TIMEOUT,
        "GATEWAY_STORE_RETRY": RETRY,
        # Clients named by X-Forwarded-For, so one test can call from many addresses.
        "GATEWAY_TRUSTED_PROXIES": '["127.0.0.1/32"]',
        "GATEWAY_LIMITS__AUTH_FAILURE_WINDOW": str(AUTH_WINDOW),
    }
    refuse = {
        "GATEWAY_LIMITS__RATE_WHEN_STORE_DOWN": "refuse",
        "GATEWAY_LIMITS__IN_FLIGHT_WHEN_STORE_DOWN": "refuse",
    }
    procs = [
        gateway_proc(tmp, base, "--workers", "2"),
        gateway_proc(tmp, {**base, **refuse}, "--workers", "2"),
    ]
    try:
        for p in procs:
            p.start("/healthz")
        for p in procs:
            ready = partial(every_worker_lists, p, 2, MODEL, auth(key("plain")))
            assert wait_for(ready, 45), p.log()
        yield procs[0], procs[1]
    finally:
        for p in procs:
            p.stop()


def fresh(gateway: Proc, name: str) -> httpx.Response:
    """One small chat request of key `name` on a new connection (either worker may take it)."""
    return HTTP.post(
        gateway.url + "/v1/chat/completions",
        json=CHAT,
        headers={**auth(key(name)), "Connection": "close"},
        timeout=30,
    )


def from_client(gateway: Proc, address: str, token: str) -> httpx.Response:
    """A small chat request with bearer `token`, from client `address` (X-Forwarded-For,
    written by the trusted loopback proxy), on a new connection."""
    headers = {
        "Authorization": f"Bearer {token}",
        "X-Forwarded-For": address,
        "Connection": "close",
    }
    return HTTP.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=30)


def worker_metric(client: httpx.Client, name: str, **labels: str) -> float:
    """`name`'s value summed over samples with `labels`, as the worker that holds
    `client`'s connection reports it."""
    text = client.get("/metrics").text
    found = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                found += s.value
    return found


def commands(store: RedisServer) -> dict[str, int]:
    """Commands the store has run, by name; INFO and the client's own hello left out."""
    with redis_client.Redis(port=store.port) as r:
        stats = r.info("commandstats")
    own = ("cmdstat_info", "cmdstat_client|setinfo", "cmdstat_hello")
    return {k: int(v["calls"]) for k, v in stats.items() if k not in own}


def test_a_key_rate_holds_across_replicas_and_workers(
    replicas: tuple[Proc, Proc], sim: Proc
) -> None:
    """Eight clients send the rated key's requests for 3 s, each on a new connection,
    to both replicas in turn: admitted <= burst + rate x elapsed (+10%), every refusal
    429 rate_limited, and the engine got the admitted ones only. Per process (no store),
    four processes would admit about four times as many."""
    gateways = list(replicas)
    before = sim_received(sim.url)
    began = time.monotonic()

    def client(n: int) -> list[int]:
        statuses = []
        while time.monotonic() - began < 3.0:
            r = fresh(gateways[len(statuses) % 2 ^ n % 2], "rated")
            assert r.status_code == 200 or error_code(r) == "rate_limited", r.text
            statuses.append(r.status_code)
        return statuses

    with ThreadPoolExecutor(8) as pool:
        statuses = [s for got in pool.map(client, range(8)) for s in got]
    elapsed = time.monotonic() - began
    admitted = statuses.count(200)
    bound = FAST["burst"] + FAST["requests_per_second"] * elapsed
    assert FAST["burst"] <= admitted <= 1.1 * bound, (admitted, bound, len(statuses))
    assert statuses.count(429) > 0
    assert sim_received(sim.url) - before == admitted


def test_a_key_in_flight_cap_holds_across_replicas_and_workers(
    replicas: tuple[Proc, Proc], sim: Proc
) -> None:
    """Eight streams of the capped key opened at once, each on its own connection, over
    both replicas: exactly CAP are answered 200 and held, the others 429; once those
    close, CAP more are admitted (the leases were given back)."""

    async def wave() -> list[int]:
        clients = [httpx.AsyncClient(base_url=replicas[n % 2].url, timeout=30) for n in range(8)]
        try:

            async def open_one(c: httpx.AsyncClient) -> tuple[int, httpx.Response]:
                request = c.build_request(
                    "POST", "/v1/chat/completions", json=LONG, headers=auth(key("capped"))
                )
                resp = await c.send(request, stream=True)
                return resp.status_code, resp

            opened = await asyncio.gather(*(open_one(c) for c in clients))
            for status, resp in opened:
                if status != 200:
                    await resp.aread()
                    assert error_code(resp) == "rate_limited", resp.text
            for _, resp in opened:
                await resp.aclose()
            return [status for status, _ in opened]
        finally:
            for c in clients:
                await c.aclose()

    before = sim_received(sim.url)
    first = asyncio.run(wave())
    assert sorted(first) == [200] * CAP + [429] * (8 - CAP), first
    # Closed streams give their leases back (a batch per loop tick): a second wave
    # finds the cap free again.
    assert wait_for(lambda: sorted(asyncio.run(wave())) == [200] * CAP + [429] * (8 - CAP), 20)
    assert sim_received(sim.url) - before >= 2 * CAP


def test_a_key_without_limits_sends_nothing_to_the_store(
    replicas: tuple[Proc, Proc], store: RedisServer
) -> None:
    """Twenty requests of a key with neither a rate nor its own cap: the store runs no
    command; the same of a rated key: it does (one engine: nothing to place)."""

    def settled() -> bool:
        # The leases of the streams before given back: a stream whose client left is
        # read for timeouts.left_grace (1 s) before its lease goes, so nothing for
        # longer than that.
        first = commands(store)
        time.sleep(1.5)
        return commands(store) == first

    assert wait_for(settled, 20)
    before = commands(store)
    for n in range(20):
        assert fresh(replicas[n % 2], "plain").status_code == 200
    assert commands(store) == before
    for n in range(4):
        assert fresh(replicas[n % 2], "probe").status_code == 200
    after = commands(store)
    assert after["cmdstat_evalsha"] >= before["cmdstat_evalsha"] + 4


def test_failed_authentications_count_across_replicas_and_workers(
    replicas: tuple[Proc, Proc], sim: Proc
) -> None:
    """24 wrong keys from one client address, 12 through each replica, each on a new
    connection (four processes, none of which sees more than 12): the first
    AUTH_FAILURES are 401 and the rest 429 too_many_failures with Retry-After, counted
    in the store; a good key from another address goes on through both replicas, and
    one never used from the flooding address does not once the process has counted a
    failure of it; nothing of the flooder reached the engine."""
    # The window is aligned to the epoch: wait out its last minute, so all fall in one.
    left = AUTH_WINDOW - time.time() % AUTH_WINDOW
    if left < 60:
        time.sleep(left + 1)
    flooder = "203.0.113.9"
    before = sim_received(sim.url)
    answers = []
    for n in range(24):
        r = from_client(replicas[n % 2], flooder, f"sk-wrong-{n:04d}-0123456789abcdef")
        answers.append((r.status_code, error_code(r)))
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
    expected = [(401, "invalid_api_key")] * AUTH_FAILURES
    assert answers == expected + [(429, "too_many_failures")] * (24 - AUTH_FAILURES)
    assert sim_received(sim.url) == before
    for gateway in replicas:
        assert from_client(gateway, "203.0.113.10", key("plain")).status_code == 200
    # A process learns of the throttle at the address's next failure in it: on one
    # connection (one worker), a wrong key is refused 429 from the store's count, and a
    # valid key never used from the flooding address is then refused without a check.
    with httpx.Client(base_url=replicas[0].url, timeout=30) as pinned:
        for token in ("sk-wrong-9999-0123456789abcdef", key("plain")):
            headers = {"Authorization": f"Bearer {token}", "X-Forwarded-For": flooder}
            r = pinned.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert (r.status_code, error_code(r)) == (429, "too_many_failures")
    assert sim_received(sim.url) == before + 2


def down_checks(replicas: tuple[Proc, Proc], sim: Proc, slow: str) -> None:
    """With the store not answering: the `local` replica admits a slow-rated key's
    burst per process (on one connection: one worker) and counts each admission as a
    fallback; the `refuse` replica answers 503 limits_unavailable for a rated and a
    capped key, and nothing of them reaches the engine."""
    local, refuse = replicas
    with httpx.Client(base_url=local.url, timeout=30) as client:
        fell_back = worker_metric(
            client, "gateway_limits_store_fallback_total", limit="rate", action="local"
        )
        got = []
        for _ in range(3):
            r = client.post("/v1/chat/completions", json=CHAT, headers=auth(key(slow)))
            got.append(r.status_code if r.status_code == 200 else error_code(r))
        assert got == [200, 200, "rate_limited"]
        counted = worker_metric(
            client, "gateway_limits_store_fallback_total", limit="rate", action="local"
        )
        assert counted - fell_back == 3
        assert worker_metric(client, "gateway_store_up") == 0
    before = sim_received(sim.url)
    for name, limit in ((slow, "rate"), ("capped-down", "in_flight")):
        with httpx.Client(base_url=refuse.url, timeout=30) as client:
            refused = worker_metric(
                client, "gateway_limits_store_fallback_total", limit=limit, action="refuse"
            )
            for _ in range(2):
                r = client.post("/v1/chat/completions", json=CHAT, headers=auth(key(name)))
                assert (r.status_code, error_code(r)) == (503, "limits_unavailable"), r.text
                assert r.headers["Retry-After"] == "1"
            counted = worker_metric(
                client, "gateway_limits_store_fallback_total", limit=limit, action="refuse"
            )
            assert counted - refused == 2
    assert sim_received(sim.url) == before


def test_a_frozen_store_is_a_store_down(
    replicas: tuple[Proc, Proc], store: RedisServer, sim: Proc
) -> None:
    """Redis frozen (SIGSTOP: it accepts and never answers): after store_timeout, the
    same as stopped; then resumed."""
    assert store.pid is not None
    os.kill(store.pid, signal.SIGSTOP)
    try:
        down_checks(replicas, sim, "slow-0")
    finally:
        os.kill(store.pid, signal.SIGCONT)


def every_worker_up(gateway: Proc) -> bool:
    """Probe requests on new connections (each worker whose breaker is open tries the
    store once store_retry is past), then twelve scrapes on new connections all read
    the store up."""
    for _ in range(16):
        fresh(gateway, "probe")
    for _ in range(12):
        with httpx.Client(base_url=gateway.url, timeout=10) as client:
            if worker_metric(client, "gateway_store_up") != 1:
                return False
    return True


def test_a_stopped_store_then_back(
    replicas: tuple[Proc, Proc], store: RedisServer, sim: Proc
) -> None:
    """Redis stopped: as its setting says for each limit. Started again (empty, as after
    a restart without persistence): shared limits again, a slow-rated key's burst of 2
    for all four processes together."""
    store.stop()
    try:
        down_checks(replicas, sim, "slow-1")
    finally:
        store.start()
    for gateway in replicas:
        assert wait_for(partial(every_worker_up, gateway), 30)
    got = [fresh(replicas[n % 2], "slow-2") for n in range(8)]
    assert [r.status_code for r in got].count(200) == SLOW["burst"], [r.status_code for r in got]
    assert all(r.status_code == 200 or error_code(r) == "rate_limited" for r in got)
