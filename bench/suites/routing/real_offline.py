"""`python -m bench routing --real-vllm --offline`: the real-engine suite's text workloads
routed in-process by the gateway's own policy, over many draws of engine URLs, with
each engine's prefix cache modelled. No engine, no timing: it shows how much of one real
run's balance and hit rate is the luck of that run's URLs (one draw), in seconds.

The model of an engine (vLLM 0.32's prefix cache, as the real run configures it): a
prompt is its words, one token each (the big models map every word of their word list
to one token, bench/harness/realvllm/models.py), and one token per message for its role;
KV blocks of 128 tokens in the simulated engine's cache (bench/sim/cache.py: blocks
chained by content, the longest run of leading blocks held found cached but never the
prompt's last token, least recently used blocks dropped beyond the engine's capacity;
the default cache drops none). Left out:
the chat template's other tokens, the requests in flight at once (a real engine pins the
running requests' blocks), replies (the workloads write them from the seed). Images are
left out: their token counts come from the model's processor.

Front ends, over `draws` URL sets (the same sets for each): the ideal engine (one engine
with the fleet's whole cache, one draw: it has no URLs to draw), `affinity` with 1, 2 and
4 replicas, and `affinity + store` likewise when redis-server is installed (a fresh
redis-server, a fresh prefix per draw; its loads decay with the clock, so its rows
move a little between runs). Replicas take each request by a seeded random
draw, as behind a load balancer that spreads connections (a strict rotation would pair
each conversation with one replica whenever the open conversations are a multiple of the
replicas).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.redis_server import RedisServer, redis_server_path
from bench.harness.server import free_port
from bench.sim.cache import PrefixCache, block_hashes
from bench.suites.report import Report
from bench.suites.routing.real import STORE, max_over_mean, wanted
from bench.suites.routing.real_report import BALANCE
from bench.suites.routing.real_workloads import EVICTION, Sizes, build
from bench.suites.routing.workloads import interleave
from gateway.routing.engine_load import RecentTokens

BLOCK = 128
WORKLOADS = ("chat", "few_shot", EVICTION)
REPLICAS = (1, 2, 4)


def prompt_blocks(
    messages: Sequence[dict[str, Any]], vocabulary: dict[str, int]
) -> tuple[list[bytes], int]:
    """A chat prompt's full KV blocks, as bench/sim/cache.py names them, and its length in
    tokens: a role token per message, then its words, each a token id from `vocabulary`
    (a new word takes the next id)."""
    ids: list[int] = []
    for message in messages:
        words = [f"<|{message['role']}|>", *str(message["content"]).split()]
        ids.extend(vocabulary.setdefault(w, len(vocabulary)) for w in words)
    return block_hashes(ids, [], BLOCK), len(ids)


@dataclass
class _Engine:
    url: str
    in_flight: int = 0
    # Its recently recomputed tokens, fed from the modelled prefix-cache counters as a
    # scrape of its /metrics would (gateway/routing/engine_load.py).
    recomputed: RecentTokens = field(default_factory=RecentTokens)


@dataclass
class Draw:
    hit_rate: float
    uncached_max_over_mean: float
    requests_max_over_mean: float
    # Calls whose key was sent before that reached the engine its previous call reached.
    follow_ups: float
    # Calls that found nothing cached: each prefills its whole prompt (a shared prompt
    # copied to one more engine, or sent for the first time), the slowest first chunks.
    cold: int = 0


@dataclass
class OfflineRow:
    workload: str
    front: str
    replicas: int
    draws: list[Draw]

    def mean(self, field: str) -> float:
        return float(statistics.mean(getattr(d, field) for d in self.draws))

    def worst_balance(self) -> float:
        return max(d.uncached_max_over_mean for d in self.draws)

    def over(self) -> int:
        return sum(d.uncached_max_over_mean > BALANCE for d in self.draws)


async def _replay(
    calls: Sequence[tuple[str | None, dict[str, Any], list[bytes], int]],
    engines: int,
    capacity: int | None,
    draw: int,
    replicas: int,
    store_url: str | None,
    scrape_every: int = 1,
) -> Draw:
    from gateway.routing.policy import Affinity, RoutingRequest
    from gateway.routing.settings import RoutingSettings
    from gateway.routing.store import PlacementStore
    from gateway.store.client import StoreClient

    rng = random.Random(f"urls:{draw}")
    ports = rng.sample(range(20000, 60000), engines)
    pool = [_Engine(f"http://127.0.0.1:{port}") for port in ports]
    caches = {e.url: PrefixCache(capacity or sys.maxsize, BLOCK) for e in pool}
    settings = RoutingSettings()
    client = None
    if store_url is not None:
        client = StoreClient(store_url, prefix=uuid.uuid4().hex[:12], timeout=5.0, retry=1.0)
    gateways = [
        Affinity(settings, None if client is None else PlacementStore(client, settings))
        for _ in range(replicas)
    ]
    pick = random.Random(f"replicas:{draw}")
    queries = hits = follow_ups = same = cold = 0
    uncached: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    last: dict[str, str] = {}
    tau = settings.store_decay

    def scrape() -> None:
        # Each engine's counters as its /metrics would show them: queries less hits is
        # its uncached tokens so far.
        now = time.monotonic()
        for e in pool:
            e.recomputed.observe(float(uncached[e.url]), now, tau)

    scrape()
    try:
        for n, (key, body, held, length) in enumerate(calls, 1):
            gateway = gateways[pick.randrange(replicas)]
            request = RoutingRequest("/v1/chat/completions", body=body)
            if engines == 1:
                url = pool[0].url
            else:
                url = (await gateway.choose(request, pool)).engines[0].url
            hit = caches[url].lookup(held, length)
            queries += length
            hits += hit
            cold += hit == 0
            uncached[url] += length - hit
            requests[url] += 1
            if n % scrape_every == 0:
                scrape()
            if key is not None:
                if key in last:
                    follow_ups += 1
                    same += last[key] == url
                last[key] = url
    finally:
        if client is not None:
            await client.aclose()
    return Draw(
        hits / queries,
        max_over_mean([uncached[e.url] for e in pool]) or 1.0,
        max_over_mean([requests[e.url] for e in pool]) or 1.0,
        same / follow_ups if follow_ups else 1.0,
        cold,
    )


def run_offline(
    sizes: Sizes,
    seed: int,
    engines: int,
    evict_tokens: int,
    draws: int,
    workdir: Path,
    workloads: Sequence[str] = WORKLOADS,
    fronts: Sequence[str] = (),
    scrape_every: int = 1,
) -> list[OfflineRow]:
    """Every workload through the ideal engine and each affinity front end (those whose
    name starts with one of `fronts`, when given), `draws` times (the store's rows when
    redis-server is installed). The engines' prefix-cache counters reach the policy
    after every `scrape_every` requests (a live gateway scrapes them every
    `load_interval` seconds)."""
    rows = []
    with ExitStack() as stack:
        store_url = None
        if redis_server_path() is not None:
            redis = stack.enter_context(RedisServer(free_port(), workdir / "redis.log"))
            store_url = redis.url
        for name in workloads:
            workload = build(name, "m", sizes, seed)
            vocabulary: dict[str, int] = {}
            calls = []
            for _, call in interleave(workload.sessions, 12):
                held, length = prompt_blocks(call.body["messages"], vocabulary)
                calls.append((call.key, call.body, held, length))
            capacity = evict_tokens if name == EVICTION else None
            ideal = capacity * engines if capacity is not None else None
            one = asyncio.run(_replay(calls, 1, ideal, 0, 1, None))
            rows.append(OfflineRow(name, "ideal", 1, [one]))
            chosen = [("affinity", None)] + ([(STORE, store_url)] if store_url else [])
            for front, url in chosen:
                if not wanted(front, fronts):
                    continue
                for replicas in REPLICAS:
                    found = [
                        asyncio.run(
                            _replay(calls, engines, capacity, d, replicas, url, scrape_every)
                        )
                        for d in range(draws)
                    ]
                    rows.append(OfflineRow(name, front, replicas, found))
    return rows


def write_offline_report(report: Report, rows: list[OfflineRow], draws: int) -> None:
    for name in dict.fromkeys(r.workload for r in rows):
        ideal = next(r for r in rows if r.workload == name and r.front == "ideal")
        table = []
        for r in rows:
            if r.workload != name:
                continue
            hit = r.mean("hit_rate")
            table.append(
                [
                    r.front if r.front == "ideal" else f"{r.front}, {r.replicas} replica(s)",
                    f"{hit:.3f}",
                    f"{hit / ideal.mean('hit_rate'):.2f}",
                    "n/a" if r.front == "ideal" else f"{r.mean('uncached_max_over_mean'):.2f}",
                    "n/a" if r.front == "ideal" else f"{r.worst_balance():.2f}",
                    "n/a" if r.front == "ideal" else f"{r.over()} of {len(r.draws)}",
                    "n/a" if r.front == "ideal" else f"{r.mean('requests_max_over_mean'):.2f}",
                    f"{r.mean('follow_ups'):.1%}",
                    f"{r.mean('cold'):.1f}",
                ]
            )
        report.table(
            f"{name} (offline, {draws} URL draws)",
            ["front end", "hit rate", "of ideal's", "max/mean uncached (mean)", "worst",
             f"draws over {BALANCE}", "max/mean requests", "follow-ups on their engine",
             "calls with nothing cached"],
            table,
        )  # fmt: skip
    report.raw["offline"] = [
        {"workload": r.workload, "front": r.front, "replicas": r.replicas,
         "draws": [d.__dict__ for d in r.draws]}
        for r in rows
    ]  # fmt: skip
