"""The shared placement store through real processes: redis-server, four simulated
engines, two gateway replicas under uvicorn taking requests in turn.

Where a request went is read from the engines' recorders (X-Request-Id), never from
the gateway. Marked `redis` (scripts/test-store.sh): these need redis-server, and are
left out of the fast suite like the real-engine tier, never skipped silently.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_client

from bench.harness.redis_server import RedisServer
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.e2e import test_routing as test_routing_e2e
from tests.e2e.test_routing import served
from tests.procs import (
    HTTP,
    Proc,
    by_worker,
    every_worker_lists,
    free_port,
    gateway_proc,
    metric,
    recording_engines,
    running,
    scrape,
    sim_proc,
    total,
    wait_for,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEY = "sk-routing-store-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ADMIN = "sk-routing-store-admin-0123456789"
PASSWORD = "store-password-0123456789"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("routing-store")


@pytest.fixture(scope="module")
def redis(tmp: Path) -> Iterator[RedisServer]:
    with RedisServer(free_port(), tmp / "redis.log") as server:
        yield server


@pytest.fixture(scope="module")
def engines(tmp: Path) -> Iterator[list[Proc]]:
    with recording_engines(tmp, 4, record=5000) as sims:
        yield sims


def store_url(redis: RedisServer) -> str:
    return f"redis://127.0.0.1:{redis.port}/0"


def start_gateway(
    tmp: Path, engines: Sequence[Proc], workers: int = 1, keys: Sequence[str] = (), **routing: str
) -> Proc:
    env = {
        "GATEWAY_ENGINES": json.dumps([e.url for e in engines]),
        "GATEWAY_API_KEYS": json.dumps(
            [KEY, *keys, {"key": ADMIN, "name": "ops", "scopes": ["admin"]}]
        ),
        "GATEWAY_ROUTING__POLICY": "affinity",
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        "GATEWAY_PUBLIC_METRICS": "true",
    }
    env.update({f"GATEWAY_ROUTING__{k.upper()}": v for k, v in routing.items()})
    proc = gateway_proc(tmp, env, "--workers", str(workers)).start("/healthz")
    assert wait_for(lambda: every_worker_lists(proc, workers, MODEL, HEADERS), 30), proc.log()
    return proc


def replicas(
    tmp: Path, engines: Sequence[Proc], count: int = 2, keys: Sequence[str] = (), **routing: str
) -> list[Proc]:
    return [start_gateway(tmp, engines, keys=keys, **routing) for _ in range(count)]


def chat(conversation: str, turns: int, system: str | None = "") -> dict[str, Any]:
    """A conversation `turns` user turns long, under its own system prompt (`system`
    empty), a shared one, or none (None)."""
    messages: list[dict[str, Any]] = []
    if system is not None:
        prompt = system or f"You are the assistant of conversation {conversation}."
        messages.append({"role": "system", "content": prompt})
    for i in range(turns):
        if i:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
        messages.append({"role": "user", "content": f"Question {i} of {conversation}."})
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


def send(client: httpx.Client, gateway: Proc, body: dict[str, Any], request_id: str) -> None:
    """One chat request with this module's key, asserted 200."""
    test_routing_e2e.send(client, gateway, body, request_id, headers=HEADERS)


def conversations_by_engine(
    engines: Sequence[Proc], run: str, conversations: int, turns: int
) -> tuple[Counter[int], int]:
    """Engine index -> conversations of this run on it; and how many were split."""
    where = served(engines)
    per_engine: Counter[int] = Counter()
    split = 0
    for c in range(conversations):
        seen = {where[f"{run}-{c}-{t}"] for t in range(turns)}
        split += len(seen) > 1
        per_engine.update(seen)
    return per_engine, split


def placements(gateway: Proc, result: str) -> float:
    return metric(gateway.url, "gateway_routing_store_placements_total", result=result)


def stopped(proc: RedisServer) -> None:
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)


def resumed(proc: RedisServer) -> None:
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGCONT)


def test_replicas_with_the_store_agree_and_spread_new_conversations_evenly(
    tmp: Path, engines: list[Proc], redis: RedisServer
) -> None:
    """24 new three-turn conversations, their turns taken by two replicas in turn: each
    stays on one engine, and each engine gets exactly 6 (the least busy takes the next
    new one). Rendezvous alone puts 24 conversations on 4 engines 6/6/6/6 in 0.3% of
    engine-URL draws (multinomial); with the store disabled this test fails. The engines
    are not scraped (`load_interval` 0), so the store counts requests, which it records
    as they are placed: the recomputed tokens each engine reports arrive a scrape later
    (test_a_new_anchor_goes_to_the_engine_that_recomputed_less)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    gateways = replicas(
        tmp, engines, store_url=store_url(redis), store_prefix=prefix, load_interval="0"
    )
    run = uuid.uuid4().hex[:8]
    try:
        with httpx.Client(timeout=10) as client:
            for c in range(24):
                for t in range(3):
                    body = chat(f"{run}-{c}", t + 1)
                    send(client, gateways[(c + t) % 2], body, f"{run}-{c}-{t}")
        per_engine, split = conversations_by_engine(engines, run, 24, 3)
        assert split == 0
        assert sorted(per_engine.values()) == [6, 6, 6, 6], per_engine
        placed = sum(placements(g, "placed") for g in gateways)
        read = sum(placements(g, "read") for g in gateways)
        assert (placed, read) == (24, 48)

        # New conversations begun on both replicas at once: whichever records first,
        # both requests reach its engine.
        def first_turn(c: int, g: int) -> None:
            with httpx.Client(timeout=10) as own:
                send(own, gateways[g], chat(f"{run}-race-{c}", 1), f"{run}-race-{c}-{g}")

        with ThreadPoolExecutor(8) as pool:
            pairs = [(c, g) for c in range(16) for g in (0, 1)]
            list(pool.map(lambda cg: first_turn(*cg), pairs))
        where = served(engines)
        assert all(where[f"{run}-race-{c}-0"] == where[f"{run}-race-{c}-1"] for c in range(16))
    finally:
        for g in gateways:
            g.stop()


def test_a_store_that_stops_answering_falls_back_and_recovers(
    tmp: Path, engines: list[Proc], redis: RedisServer
) -> None:
    """Redis frozen (SIGSTOP: slower than any timeout), then stopped, then started
    again: every request is answered, the ones placed without the store are counted,
    the change of state is logged once each way without the password, and the store is
    used again once it answers."""
    # Its own server, protected by a password the URL carries: no log line may show it.
    secured = RedisServer(free_port(), tmp / "redis-secured.log")
    secured.start(extra=["--requirepass", PASSWORD])
    url = f"redis://:{PASSWORD}@127.0.0.1:{secured.port}/0"
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    gateway = start_gateway(
        tmp, engines, store_url=url, store_prefix=prefix, store_timeout="0.05", store_retry="0.3"
    )
    run = uuid.uuid4().hex[:8]

    def count(result: str) -> float:
        return placements(gateway, result)

    def ask(n: int, tag: str) -> float:
        """Sends n new conversations' first turns; returns the slowest answer's time."""
        slowest = 0.0
        with httpx.Client(timeout=10) as client:
            for c in range(n):
                began = time.monotonic()
                send(client, gateway, chat(f"{run}-{tag}-{c}", 1), f"{run}-{tag}-{c}")
                slowest = max(slowest, time.monotonic() - began)
        return slowest

    try:
        ask(5, "before")
        assert count("placed") == 5 and count("fallback") == 0
        assert metric(gateway.url, "gateway_routing_store_up") == 1

        stopped(secured)
        try:
            slowest = ask(20, "frozen")
            assert count("fallback") == 20
            assert metric(gateway.url, "gateway_routing_store_up") == 0
            # A 0.05 s timeout, then 0.3 s without trying: no request waits long.
            assert slowest < 2.0
        finally:
            resumed(secured)
        secured.stop()
        ask(10, "down")
        assert count("fallback") == 30

        secured.start(extra=["--requirepass", PASSWORD])
        time.sleep(0.5)  # past store_retry
        assert wait_for(lambda: ask(1, f"back-{time.monotonic_ns()}") >= 0 and count("placed") > 5)
        assert metric(gateway.url, "gateway_routing_store_up") == 1
        log = gateway.log()
        assert PASSWORD not in log
        states = [line for line in log.splitlines() if '"event":"store"' in line]
        assert sum('"down"' in line or "state=down" in line for line in states) == 1, states
        assert sum('"up"' in line or "state=up" in line for line in states) == 1, states
    finally:
        gateway.stop()
        secured.stop()


def test_the_placement_script_is_loaded_before_the_first_request(
    tmp: Path, engines: list[Proc]
) -> None:
    """A gateway connects to the store and loads its placement script as it starts, so
    its first placed request pays for neither (a round trip and the script's compile on
    the store, about 2.5 ms measured)."""
    from gateway.routing.store import PLACE

    fresh = RedisServer(free_port(), tmp / "redis-fresh.log").start()
    try:
        sha = hashlib.sha1(PLACE.encode()).hexdigest()
        store = redis_client.Redis(port=fresh.port)
        assert store.script_exists(sha) == [False]
        gateway = start_gateway(tmp, engines, store_url=store_url(fresh))
        try:
            assert store.script_exists(sha) == [True]
            assert placements(gateway, "placed") == 0
        finally:
            gateway.stop()
        store.close()
    finally:
        fresh.stop()


def test_two_workers_share_the_store(tmp: Path, engines: list[Proc], redis: RedisServer) -> None:
    """One gateway with `--workers 2`: its worker processes share placements as
    replicas do. 20 new three-turn conversations, every request on a new connection
    (either worker may take it): none split, 5 on each engine, both workers placed some
    of them (/gateway/status on the same connection names the worker), and a scrape
    counts every placement of both. Placed by requests, as above (`load_interval` 0)."""
    gateway = start_gateway(
        tmp,
        engines,
        workers=2,
        store_url=store_url(redis),
        store_prefix=f"test-{uuid.uuid4().hex[:8]}",
        load_interval="0",
    )
    run = uuid.uuid4().hex[:8]
    workers: Counter[int] = Counter()
    try:
        for c in range(20):
            for t in range(3):

                def post(client: httpx.Client, c: int = c, t: int = t) -> None:
                    body = chat(f"{run}-{c}", t + 1)
                    headers = {**HEADERS, "X-Request-Id": f"{run}-{c}-{t}"}
                    r = client.post("/v1/chat/completions", json=body, headers=headers)
                    assert r.status_code == 200, r.text

                [(pid, _)] = by_worker(gateway.url, ADMIN, post, 1)
                workers[pid] += 1
        per_engine, split = conversations_by_engine(engines, run, 20, 3)
        assert split == 0
        assert sorted(per_engine.values()) == [5, 5, 5, 5], per_engine
        assert len(workers) == 2, workers

        def placements() -> float:
            samples = scrape(gateway.url + "/metrics")
            return total(
                samples, "gateway_routing_store_placements_total", result="placed"
            ) + total(samples, "gateway_routing_store_placements_total", result="read")

        # Each worker copies its counts for the scrape once a second.
        assert wait_for(lambda: placements() == 60, 30), placements()
    finally:
        gateway.stop()


def test_one_keys_new_prefixes_displace_only_its_own_placements(
    tmp: Path, engines: list[Proc], redis: RedisServer
) -> None:
    """routing.store_anchors_per_key 4, two replicas: a victim key begins 3
    conversations (without system prompts: one anchor each), then a flooding key begins
    40 through both replicas. The store holds
    the victim's 3 and the flooder's last 4 anchors (36 of the flooder's dropped, counted
    in gateway_routing_store_anchors_dropped_total); the victim's second turns read their
    placements and stay on their engines; the flooder's first conversation is placed
    anew, its last read. An anchor stays its placer's: the flooder using one of the
    victim's conversations and then beginning 4 more drops 4 of its own, and the victim's
    is read again. An unbounded store holds all 43."""
    flood = "sk-routing-store-flood-0123456789"
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    gateways = replicas(
        tmp,
        engines,
        keys=[flood],
        store_url=store_url(redis),
        store_prefix=prefix,
        store_anchors_per_key="4",
    )
    run = uuid.uuid4().hex[:8]
    flooding = {"Authorization": f"Bearer {flood}"}

    def anchors() -> int:
        with redis_client.Redis(port=redis.port) as r:
            return sum(1 for _ in r.scan_iter(f"{prefix}:a:*"))

    def counted() -> tuple[float, float, float]:
        return (
            sum(placements(g, "placed") for g in gateways),
            sum(placements(g, "read") for g in gateways),
            sum(metric(g.url, "gateway_routing_store_anchors_dropped_total") for g in gateways),
        )

    try:
        with httpx.Client(timeout=10) as client:
            for c in range(3):
                send(client, gateways[c % 2], chat(f"{run}-v{c}", 1, None), f"{run}-v{c}-0")
            for c in range(40):
                test_routing_e2e.send(
                    client, gateways[c % 2], chat(f"{run}-f{c}", 1, None), f"{run}-f{c}-0", flooding
                )
            assert anchors() == 3 + 4
            assert counted() == (43, 0, 36)
            for c in range(3):
                send(client, gateways[(c + 1) % 2], chat(f"{run}-v{c}", 2, None), f"{run}-v{c}-1")
            assert counted() == (43, 3, 36)
            where = served(engines)
            assert all(where[f"{run}-v{c}-0"] == where[f"{run}-v{c}-1"] for c in range(3))
            # The flooder's newest conversation is still placed; its oldest was dropped.
            for c in (39, 0):
                test_routing_e2e.send(
                    client, gateways[0], chat(f"{run}-f{c}", 2, None), f"{run}-f{c}-1", flooding
                )
            # f0 placed anew displaced the flooder's least recently used (f36).
            assert counted() == (44, 4, 37)
            # The flooder using the victim's conversation does not make it the
            # flooder's: its next four new ones drop four of its own, not the victim's.
            test_routing_e2e.send(
                client, gateways[1], chat(f"{run}-v0", 2, None), f"{run}-v0-f", flooding
            )
            for c in range(40, 44):
                test_routing_e2e.send(
                    client, gateways[c % 2], chat(f"{run}-f{c}", 1, None), f"{run}-f{c}-0", flooding
                )
            send(client, gateways[0], chat(f"{run}-v0", 3, None), f"{run}-v0-2")
            assert counted() == (48, 6, 41)
            assert anchors() == 3 + 4
    finally:
        for g in gateways:
            g.stop()


def test_a_new_replica_keeps_conversations_where_a_warm_one_put_them(
    tmp: Path, engines: list[Proc], redis: RedisServer
) -> None:
    """A replica that has sent 60 turns of 20 conversations under one system prompt
    spreads that prompt (its conversations anchor on their first user message); a
    replica started after them has not seen it shared, and anchors the first
    conversations it meets on the prompt. 12 new four-turn conversations, their turns
    taken by the two in turn (half begun by each): with the store every conversation
    keeps all its turns on one engine, because the first turn records the conversation
    (its first user message) with the engine chosen, whichever anchor decided. On the
    code before, the new replica's first turns went to the prompt's engine and the warm
    one's to the conversation's: the first conversation it met split (1 of 12) in the
    run that checked it."""
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    shared = "You are the support assistant of a shop. Answer briefly and politely. " * 4
    warm = start_gateway(tmp, engines, store_url=store_url(redis), store_prefix=prefix)
    run = uuid.uuid4().hex[:8]
    cold: Proc | None = None
    try:
        with httpx.Client(timeout=10) as client:
            for t in range(3):
                for c in range(20):
                    body = chat(f"{run}-warm-{c}", t + 1, shared)
                    send(client, warm, body, f"{run}-warm-{c}-{t}")
            cold = start_gateway(tmp, engines, store_url=store_url(redis), store_prefix=prefix)
            pair = (cold, warm)
            for c in range(12):
                for t in range(4):
                    body = chat(f"{run}-{c}", t + 1, shared)
                    send(client, pair[(c + t) % 2], body, f"{run}-{c}-{t}")
        per_engine, split = conversations_by_engine(engines, run, 12, 4)
        assert split == 0, per_engine
        # The warm replica spread its conversations: the rule did not just put every
        # conversation on one engine.
        where = served(engines)
        assert len({where[f"{run}-warm-{c}-0"] for c in range(20)}) > 1
    finally:
        warm.stop()
        if cold is not None:
            cold.stop()


def test_a_placement_outside_its_prompts_stretch_moves_into_it(
    tmp: Path, engines: list[Proc], redis: RedisServer
) -> None:
    """A shared system prompt carrying a ninth of the traffic is hot: its conversations
    spread over its stretch of the line of engines, 16 x 1/9 = 1.8 engines long from the
    line's start (the only hot prompt), so on the line's first two engines. A
    conversation recorded on the line's last engine (placed there before the prompt was
    hot, or before its stretch moved) is placed anew inside the stretch at its next turn:
    no engine keeps a copy of the prompt for a stray conversation. On the code before,
    the record held wherever it pointed while that engine was healthy."""
    from gateway.routing.anchors import AnchorKind, candidate_anchors
    from gateway.routing.policy import _line
    from gateway.routing.settings import RoutingSettings

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    gateway = start_gateway(tmp, engines, store_url=store_url(redis), store_prefix=prefix)
    run = uuid.uuid4().hex[:8]
    shared = "You answer questions about the weather in short sentences. " * 8
    line = _line(tuple(e.url for e in engines))
    urls = [e.url for e in engines]
    stretch = {urls.index(line[0]), urls.index(line[1])}
    try:
        with httpx.Client(timeout=10) as client:
            for c in range(5):
                for t in range(2):
                    send(client, gateway, chat(f"{run}-{c}", t + 1, shared), f"{run}-{c}-{t}")
            for u in range(80):
                send(client, gateway, chat(f"{run}-alone-{u}", 1, None), f"{run}-alone-{u}")
            # The prompt's share is now 10 / 90: a new conversation under it goes to the
            # stretch.
            send(client, gateway, chat(f"{run}-new", 1, shared), f"{run}-new-0")
            assert served(engines)[f"{run}-new-0"] in stretch

            stray = chat(f"{run}-stray", 2, shared)
            settings = RoutingSettings()
            first_user = next(
                a
                for a in candidate_anchors(
                    stray,
                    block_bytes=settings.prompt_block_bytes,
                    max_candidates=settings.max_candidates,
                )
                if a.kind is AnchorKind.first_user
            )
            with redis_client.Redis(port=redis.port) as r:
                r.hset(
                    f"{prefix}:a:{first_user.digest.hex()}",
                    mapping={"u": line[3], "t": time.time(), "k": "anonymous"},
                )
            send(client, gateway, stray, f"{run}-stray-1")
        where = served(engines)
        assert where[f"{run}-stray-1"] in stretch, (where[f"{run}-stray-1"], stretch)
    finally:
        gateway.stop()


def test_a_new_anchor_goes_to_an_engine_idle_now(tmp: Path, redis: RedisServer) -> None:
    """A new anchor is placed by what the store recorded plus each engine's requests now:
    with nothing recorded (a fresh prefix), a new conversation whose first choice is
    busy with a long answer (sent to the engine directly, so the store never counted it;
    the gateway sees it in the engine's scraped `vllm:num_requests_running`) goes to the
    idle engine, where its first prefill does not meet it. On the code before, the tie
    went to the first choice. Its next turn follows the placement."""
    from gateway.routing.anchors import candidate_anchors
    from gateway.routing.rendezvous import rendezvous_order
    from gateway.routing.settings import RoutingSettings

    settings = RoutingSettings()
    run = uuid.uuid4().hex[:8]
    body = chat(f"{run}-new", 1)
    # Nothing is hot: the conversation's own system prompt decides.
    anchor = candidate_anchors(
        body, block_bytes=settings.prompt_block_bytes, max_candidates=settings.max_candidates
    )[0]
    # Engines that take their time: a 600-token answer streams for ~5 s.
    sims = [sim_proc(tmp, "--record-requests", "100") for _ in range(2)]
    with running(*sims):
        top = rendezvous_order(anchor.digest, sims)[0]
        busy_index = sims.index(top)
        gateway = start_gateway(
            tmp,
            sims,
            store_url=store_url(redis),
            store_prefix=f"test-{run}",
            load_interval="0.2",
        )
        long = {**chat(f"{run}-long", 1), "max_tokens": 600, "stream": True}

        def answer_long() -> int:
            url = top.url + "/v1/chat/completions"
            with httpx.Client(timeout=60) as c, c.stream("POST", url, json=long) as r:
                r.read()
                return r.status_code

        def busy() -> bool:
            status = HTTP.get(
                gateway.url + "/gateway/status",
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=5,
            ).json()
            return any(e["url"] == top.url and e["running"] for e in status["engines"])

        try:
            with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=10) as client:
                done = pool.submit(answer_long)
                assert wait_for(busy, 10), gateway.log()
                send(client, gateway, body, f"{run}-new-0")
                send(client, gateway, chat(f"{run}-new", 2), f"{run}-new-1")
                assert done.result() == 200
            where = served(sims)
            assert where[f"{run}-new-0"] == 1 - busy_index, (where, busy_index)
            assert where[f"{run}-new-1"] == where[f"{run}-new-0"]
        finally:
            gateway.stop()


A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def place_after(
    redis: RedisServer,
    recorded: Sequence[str],
    loads: list[int],
    tokens: Sequence[float | None] | None,
) -> str | None:
    """Where a fresh store places a new anchor that may go to `A` or `B`, after one
    request to each of `recorded` (each anchor's only choice), with those loads now and
    recomputed tokens."""
    from gateway.routing.settings import RoutingSettings
    from gateway.routing.store import PlacementStore
    from gateway.store.client import StoreClient

    async def scenario() -> str | None:
        client = StoreClient(
            store_url(redis), prefix=f"test-{uuid.uuid4().hex[:8]}", timeout=5.0, retry=1.0
        )
        store = PlacementStore(client, RoutingSettings())
        try:
            for i, url in enumerate(recorded):
                assert await store.place(bytes([i]) * 16, [url], None, None, [0]) == url
            return await store.place(b"n" * 16, [A, B], None, None, loads, tokens)
        finally:
            await client.aclose()

    return asyncio.run(scenario())


def test_a_new_anchor_goes_to_an_idle_engine_unless_it_recomputed_far_more(
    redis: RedisServer,
) -> None:
    """While one engine a new anchor may go to has nothing running, and its load is
    within a tenth of the least loaded's plus one request's worth, the idle one is
    chosen: `A` recomputed a little less than `B` but is prefilling a request now, so
    the new anchor's first prefill goes to `B` instead of meeting that request (`A` on
    the code before the idle rule). When `B` recomputed far more, `A` wins all the same:
    an engine that evicts would otherwise take every new conversation it is idle for
    (`B` with the idle rule before this margin). With both busy, or both idle, the tokens
    decide (`A`)."""
    # Requests recorded on both, so that the tokens weigh in.
    both = [A, B, A, B]
    assert place_after(redis, both, [1, 0], [1000.0, 2000.0]) == B
    assert place_after(redis, both, [1, 0], [100.0, 9000.0]) == A
    assert place_after(redis, both, [0, 0], [1000.0, 2000.0]) == A
    assert place_after(redis, both, [2, 1], [1000.0, 2000.0]) == A


def test_a_new_anchor_goes_to_an_engine_whose_requests_from_here_have_ended(
    redis: RedisServer,
) -> None:
    """The store weighs each engine's requests now: this process's in flight now, plus
    the other processes' as last scraped. Both engines were scraped with one request
    running; `first`'s was this process's and has ended since, `second`'s another
    process's. A new conversation whose first choice is `second` goes to `first`, idle
    now. By the scraped load (the code before) both were busy and it went to `second`;
    the load bound still reads the scrape (one each)."""
    from gateway.routing.engine import Engine
    from gateway.routing.policy import Affinity, RoutingRequest
    from gateway.routing.rendezvous import rendezvous_order
    from gateway.routing.settings import RoutingSettings
    from gateway.routing.store import PlacementStore
    from gateway.store.client import StoreClient

    settings = RoutingSettings()
    body = chat(uuid.uuid4().hex[:8], 1)
    policy = Affinity(settings)
    pool = [Engine(A), Engine(B)]
    anchor, _, _, _ = policy._decide(RoutingRequest("/v1/chat/completions", body=body), pool, False)
    assert anchor is not None
    second, first = rendezvous_order(anchor.digest, pool)
    for engine, mine in ((first, 1), (second, 0)):
        engine.healthy, engine.scraped, engine.running, engine.mine_at_scrape = True, True, 1, mine
    assert (first.busy, second.busy, first.load, second.load) == (0, 1, 1, 1)

    async def scenario() -> str:
        client = StoreClient(
            store_url(redis), prefix=f"test-{uuid.uuid4().hex[:8]}", timeout=5.0, retry=1.0
        )
        policy.store = PlacementStore(client, settings)
        try:
            request = RoutingRequest("/v1/chat/completions", body=body)
            decision = await policy.choose(request, pool)
            return decision.engines[0].url
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == first.url


def test_a_new_anchor_goes_where_the_engines_recomputed_least(redis: RedisServer) -> None:
    """With every choice's recomputed tokens measured (its scraped prefix-cache counters),
    a new anchor's engine is chosen by tokens: each engine's own, plus its expected
    requests at the choices' mean tokens per request. Engine `B` took three requests and
    `A` one, but `A`'s was a long cold prefill: a new anchor goes to `B`. By requests
    alone (the code before, or any choice unmeasured) it goes to `A`."""
    recorded = [A, B, B, B]
    assert place_after(redis, recorded, [0, 0], [9000.0, 1200.0]) == B
    assert place_after(redis, recorded, [0, 0], [9000.0, None]) == A
    assert place_after(redis, recorded, [0, 0], [0.0, 0.0]) == A
    assert place_after(redis, recorded, [0, 0], None) == A


def test_a_new_anchor_goes_to_the_engine_that_recomputed_less(
    tmp: Path, redis: RedisServer
) -> None:
    """Live: the gateway scrapes each engine's prefix-cache counters, and the store places
    a new anchor by the prompt tokens each engine recomputed lately. A conversation placed
    through the gateway leaves one request recorded on one engine; then a long prompt
    sent to the other engine directly (never counted by the store) makes that one
    recompute thousands of tokens. A new conversation whose first choice is that engine
    goes to the first one; by requests alone (the code before) it went to its first
    choice, which had none recorded."""
    from gateway.routing.anchors import candidate_anchors
    from gateway.routing.rendezvous import rendezvous_order
    from gateway.routing.settings import RoutingSettings

    settings = RoutingSettings()
    run = uuid.uuid4().hex[:8]

    def first_choice(body: dict[str, Any], sims: Sequence[Proc]) -> Proc:
        anchor = candidate_anchors(
            body, block_bytes=settings.prompt_block_bytes, max_candidates=settings.max_candidates
        )[0]
        return rendezvous_order(anchor.digest, sims)[0]

    sims = [sim_proc(tmp, "--record-requests", "100") for _ in range(2)]
    with running(*sims):
        # A new conversation's first choice (busy), and an earlier one's on the other engine.
        new = chat(f"{run}-new", 1)
        busy = first_choice(new, sims)
        other = sims[1 - sims.index(busy)]
        early = next(
            name
            for name in (f"{run}-early-{i}" for i in range(64))
            if first_choice(chat(name, 1), sims) is other
        )
        gateway = start_gateway(
            tmp, sims, store_url=store_url(redis), store_prefix=f"test-{run}", load_interval="0.2"
        )

        def scraped(url: str) -> dict[str, Any]:
            status = HTTP.get(
                gateway.url + "/gateway/status",
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=5,
            ).json()
            found: dict[str, Any] = next(e for e in status["engines"] if e["url"] == url)
            return found

        def recomputed(url: str) -> float | None:
            tokens: float | None = scraped(url)["recomputed_tokens"]
            return tokens

        try:
            # Both engines' counters read once (the baseline) before anything is sent.
            assert wait_for(lambda: recomputed(busy.url) is not None, 10), gateway.log()
            assert wait_for(lambda: recomputed(other.url) is not None, 10), gateway.log()
            with httpx.Client(timeout=10) as client:
                send(client, gateway, chat(early, 1), f"{run}-early")
                long = {**chat(f"{run}-long", 1, system="word " * 4000), "max_tokens": 1}
                resp = HTTP.post(busy.url + "/v1/chat/completions", json=long, timeout=30)
                assert resp.status_code == 200, resp.text
                # Read after the long prompt ended: the engine is idle again.
                assert wait_for(
                    lambda: (
                        (recomputed(busy.url) or 0) > 3000 and scraped(busy.url)["running"] == 0
                    ),
                    10,
                ), gateway.log()
                send(client, gateway, new, f"{run}-new-0")
                send(client, gateway, chat(f"{run}-new", 2), f"{run}-new-1")
            where = served(sims)
            assert where[f"{run}-early"] == sims.index(other)
            assert where[f"{run}-new-0"] == sims.index(other), (where, sims.index(busy))
            assert where[f"{run}-new-1"] == where[f"{run}-new-0"]
        finally:
            gateway.stop()
