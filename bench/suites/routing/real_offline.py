"""`python -m bench routing --real-vllm --offline`: the real-engine suite's text workloads
routed in-process by the gateway's own policy, over many draws of engine URLs, with
each engine's prefix cache modelled. No engine, no timing: it shows how much of one real
run's balance and hit rate is the luck of that run's URLs (one draw), in seconds.

The model of an engine (vLLM 0.32's prefix cache, as the real run configures it): a
prompt is its words, one token each (the big models map every word of their word list
to one token, bench/harness/realvllm/models.py), and one token per message for its role;
KV blocks of 128 tokens, chained by content; a request finds cached its longest run of
leading blocks held, then every full block of its prompt is held and the least recently
used blocks beyond the engine's capacity are dropped (the default cache: none). Left out:
the chat template's other tokens, the requests in flight at once (a real engine pins the
running requests' blocks), replies (the workloads write them from the seed). Images are
left out: their token counts come from the model's processor.

Front ends, over `draws` URL sets (the same sets for each): the ideal engine (one engine
with the fleet's whole cache, one draw: it has no URLs to draw), `affinity` with 1, 2 and
4 replicas, and `affinity + store` likewise when redis-server is installed (a fresh
redis-server, a fresh prefix per draw). Replicas take each request by a seeded random
draw, as behind a load balancer that spreads connections (a strict rotation would pair
each conversation with one replica whenever the open conversations are a multiple of the
replicas).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import statistics
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.redis_server import RedisServer, redis_server_path
from bench.harness.server import free_port
from bench.suites.report import Report
from bench.suites.routing.real_workloads import EVICTION, Sizes, build
from bench.suites.routing.workloads import interleave

BLOCK = 128
WORKLOADS = ("chat", "few_shot", EVICTION)
REPLICAS = (1, 2, 4)
BALANCE = 1.25
STORE = "affinity + store"


def tokens(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The prompt as the model sees it, roughly: a role token per message, then its words."""
    out: list[str] = []
    for message in messages:
        out.append(f"<|{message['role']}|>")
        out.extend(str(message["content"]).split())
    return out


def blocks(prompt: Sequence[str]) -> list[bytes]:
    """The prompt's full KV blocks, each named by its content and every block before it."""
    digest = b""
    out = []
    for start in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
        text = "\x00".join(prompt[start : start + BLOCK]).encode()
        digest = hashlib.blake2b(digest + text, digest_size=12).digest()
        out.append(digest)
    return out


class PrefixCache:
    """One engine's prefix cache: blocks by recency, at most `capacity` tokens of them."""

    def __init__(self, capacity: int | None) -> None:
        self._limit = None if capacity is None else capacity // BLOCK
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def serve(self, prompt: Sequence[str]) -> int:
        """Serve a prompt: the tokens found cached (never the whole prompt: the engine
        computes its last token again), then hold its blocks."""
        held = blocks(prompt)
        hit = 0
        for block in held:
            if block not in self._blocks:
                break
            hit += 1
        for block in held:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while self._limit is not None and len(self._blocks) > self._limit:
            self._blocks.popitem(last=False)
        return min(hit * BLOCK, len(prompt) - 1)


@dataclass
class _Engine:
    url: str
    in_flight: int = 0


@dataclass
class Draw:
    hit_rate: float
    uncached_max_over_mean: float
    requests_max_over_mean: float
    # Calls whose key was sent before that reached the engine its previous call reached.
    follow_ups: float


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


def _max_over_mean(values: Sequence[float]) -> float:
    mean = statistics.mean(values)
    return max(values) / mean if mean else 1.0


async def _replay(
    calls: Sequence[tuple[str | None, dict[str, Any], list[str]]],
    engines: int,
    capacity: int | None,
    draw: int,
    replicas: int,
    store_url: str | None,
) -> Draw:
    from gateway.routing.policy import Affinity, RoutingRequest
    from gateway.routing.settings import RoutingSettings
    from gateway.routing.store import PlacementStore
    from gateway.store.client import StoreClient

    rng = random.Random(f"urls:{draw}")
    ports = rng.sample(range(20000, 60000), engines)
    pool = [_Engine(f"http://127.0.0.1:{port}") for port in ports]
    caches = {e.url: PrefixCache(capacity) for e in pool}
    settings = RoutingSettings()
    client = None
    if store_url is not None:
        client = StoreClient(store_url, prefix=uuid.uuid4().hex[:12], timeout=5.0, retry=1.0)
    gateways = [
        Affinity(settings, None if client is None else PlacementStore(client, settings))
        for _ in range(replicas)
    ]
    pick = random.Random(f"replicas:{draw}")
    queries = hits = follow_ups = same = 0
    uncached: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    last: dict[str, str] = {}
    try:
        for key, body, prompt in calls:
            gateway = gateways[pick.randrange(replicas)]
            request = RoutingRequest("/v1/chat/completions", body=body)
            if engines == 1:
                url = pool[0].url
            else:
                url = (await gateway.choose(request, pool)).engines[0].url
            hit = caches[url].serve(prompt)
            queries += len(prompt)
            hits += hit
            uncached[url] += len(prompt) - hit
            requests[url] += 1
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
        _max_over_mean([uncached[e.url] for e in pool]),
        _max_over_mean([requests[e.url] for e in pool]),
        same / follow_ups if follow_ups else 1.0,
    )


def run_offline(
    sizes: Sizes,
    seed: int,
    engines: int,
    evict_tokens: int,
    draws: int,
    workdir: Path,
    workloads: Sequence[str] = WORKLOADS,
) -> list[OfflineRow]:
    """Every workload through the ideal engine and each affinity front end, `draws` times
    (the store's rows when redis-server is installed)."""
    rows = []
    with ExitStack() as stack:
        store_url = None
        if redis_server_path() is not None:
            redis = stack.enter_context(RedisServer(free_port(), workdir / "redis.log"))
            store_url = redis.url
        for name in workloads:
            workload = build(name, "m", sizes, seed)
            calls = []
            for _, call in interleave(workload.sessions, 12):
                calls.append((call.key, call.body, tokens(call.body["messages"])))
            capacity = evict_tokens if name == EVICTION else None
            ideal = capacity * engines if capacity is not None else None
            one = asyncio.run(_replay(calls, 1, ideal, 0, 1, None))
            rows.append(OfflineRow(name, "ideal", 1, [one]))
            fronts = [("affinity", None)] + ([(STORE, store_url)] if store_url else [])
            for front, url in fronts:
                for replicas in REPLICAS:
                    found = [
                        asyncio.run(_replay(calls, engines, capacity, d, replicas, url))
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
                ]
            )
        report.table(
            f"{name} (offline, {draws} URL draws)",
            ["front end", "hit rate", "of ideal's", "max/mean uncached (mean)", "worst",
             f"draws over {BALANCE}", "max/mean requests", "follow-ups on their engine"],
            table,
        )  # fmt: skip
    report.raw["offline"] = [
        {"workload": r.workload, "front": r.front, "replicas": r.replicas,
         "draws": [d.__dict__ for d in r.draws]}
        for r in rows
    ]  # fmt: skip
