"""The offline replay: the workloads routed in-process by the gateway's own policy, with
the engines' prefix caches modelled by bench.sim's cache code (no servers, no timing)."""

from __future__ import annotations

import hashlib
import random
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench.suites.routing.options import Options
from bench.suites.routing.workloads import Workload, follow, interleave


@dataclass
class Engine:
    url: str
    in_flight: int = 0


@dataclass
class _Prompt:
    """What a simulated engine makes of a call (bench/sim/prompt.py)."""

    body: dict[str, Any]
    tokens: list[int]
    spans: list[Any]
    items: list[Any]


def _prompt(body: dict[str, Any]) -> _Prompt:
    from bench.sim import tokenizer
    from bench.sim.media import MediaItem
    from bench.sim.prompt import assemble, chat_segments, media_refs

    if "messages" not in body:
        return _Prompt(body, tokenizer.encode(body["prompt"]), [], [])
    segments = chat_segments(body["messages"])
    items = [
        MediaItem("image", hashlib.blake2b(r.url.encode(), digest_size=16).digest(), 443, False)
        for r in media_refs(segments)
    ]
    tokens, spans = assemble(segments, items)
    return _Prompt(body, tokens, spans, items)


def _reply(prompt: _Prompt, blocks: list[bytes]) -> tuple[str, list[bytes]]:
    """The simulated engine's reply to a chat call (whose prompt has these `blocks`),
    and the blocks it caches after the prompt's (bench/sim/engine.py), block size 16."""
    from bench.sim.generate import output
    from bench.sim.prompt import reply_blocks

    if "messages" not in prompt.body:
        return "", []
    body = prompt.body
    pieces, _ = output(prompt.tokens, body["max_tokens"], bool(body.get("ignore_eos")))
    reply = "".join(pieces)
    return reply, reply_blocks(prompt.tokens, prompt.spans, blocks, reply, 16)


@dataclass
class OfflineResult:
    policy: str
    hit_rate: float
    uncached: float
    # Mean and worst over the draws of max / mean requests per engine.
    spread: float
    worst_spread: float
    # Follow-up agreement (mean and worst over the draws): of the measured calls whose
    # key (conversation, image) was routed before, the fraction that went to the same
    # engine as the key's previous call. None where the workload has no such calls.
    agreement: float | None = None
    worst_agreement: float | None = None
    # Draws whose max / mean requests is above the goal's 1.3.
    over: int = 0
    draws: int = 1
    # Balls into bins (affinity, one gateway): the measured requests grouped by the
    # anchor that decided them, each group thrown at a uniformly random engine
    # (`BINS_TRIALS` times): the mean max / mean and the share of throws above 1.3.
    # What any rule that keeps each anchor's requests on one engine it picks blindly
    # of history gets, whatever its hash.
    bins_spread: float | None = None
    bins_over: float | None = None


REPLICAS = (1, 2, 4)
GOAL_SPREAD = 1.3
BINS_TRIALS = 10_000


def balls_into_bins(
    weights: list[int], bins: int, trials: int = BINS_TRIALS
) -> tuple[float, float]:
    """Groups of requests of these sizes thrown at `bins` engines uniformly at random:
    the mean max / mean over `trials` throws, and the share of throws above 1.3."""
    rng = random.Random(0)
    mean = sum(weights) / bins
    spreads = []
    for _ in range(trials):
        load = [0] * bins
        for w in weights:
            load[rng.randrange(bins)] += w
        spreads.append(max(load) / mean)
    return statistics.mean(spreads), sum(x > GOAL_SPREAD for x in spreads) / trials


def _name(replicas: int) -> str:
    return "affinity" if replicas == 1 else f"affinity, {replicas} replicas"


def offline(
    workload: Workload, settings: dict[str, Any], draws: int, opts: Options
) -> list[OfflineResult]:
    """Route the workload in-process, in `interleave`'s order, with the engines' LRU
    prefix caches modelled by bench.sim's own cache code, over `draws` sets of engine
    URLs: the ideal engine (all the cache), round robin (a random engine per request),
    and `affinity` with `settings` as one gateway and as 2 and 4 replicas taking
    requests in turn (round robin, as behind a plain load balancer).
    No load, no timing: it isolates the key and the hot rule, deterministically, in
    seconds. The warm-up is routed but not counted, as in the live run."""
    from bench.sim.cache import PrefixCache, block_hashes
    from gateway.routing.policy import Affinity, RoutingRequest
    from gateway.routing.settings import RoutingSettings

    order = interleave(workload.sessions[: workload.warmup], opts.live)
    warm = len(order)
    order += [(workload.warmup + i, c) for i, c in interleave(workload.measured, opts.live)]
    # Replies are deterministic, so every policy sends the same bodies: resolve them once.
    previous: dict[int, tuple[dict[str, Any], str]] = {}
    calls = []
    for session, call in order:
        body = follow(call, *previous.get(session, (None, "")))
        prompt = _prompt(body)
        blocks = block_hashes(prompt.tokens, prompt.spans, 16)
        reply, reply_blocks = _reply(prompt, blocks)
        previous[session] = (body, reply)
        calls.append((call, prompt, blocks, reply_blocks))
    out = []
    for policy in ("ideal", "round_robin", *(_name(r) for r in REPLICAS)):
        hit_rates, uncached, spreads, agreements = [], [], [], []
        bins: tuple[float, float] | None = None
        replicas = int(policy.split(", ")[1].split()[0]) if ", " in policy else 1
        for draw in range(draws if policy.startswith("affinity") else 1):
            engines = 1 if policy == "ideal" else opts.engines
            pool = [Engine(f"http://10.{draw}.0.{i}:8000") for i in range(engines)]
            capacity = opts.kv_cache_tokens * opts.engines // engines
            caches = {e.url: PrefixCache(capacity, 16) for e in pool}
            # Replicas take requests in turn, as behind a plain load balancer.
            gateways = [Affinity(RoutingSettings(**settings)) for _ in range(replicas)]
            load = dict.fromkeys(caches, 0)
            shuffle = random.Random(draw)
            queries = hits = follow_ups = same = 0
            last: dict[str, str] = {}
            anchors: Counter[str | None] = Counter()
            for index, (call, prompt, blocks, reply_blocks) in enumerate(calls):
                if policy.startswith("affinity"):
                    request = RoutingRequest(call.path, body=prompt.body)
                    url = gateways[index % replicas].order(request, pool)[0].url
                    if index >= warm:
                        anchors[request.anchor] += 1
                else:
                    # Round robin: live, timing decides which turn of a conversation
                    # meets which engine; a strict rotation here would send every
                    # turn of a conversation to one engine whenever the number of
                    # open sessions is a multiple of the engine count.
                    url = pool[shuffle.randrange(engines)].url
                hit = caches[url].lookup(blocks, len(prompt.tokens))
                caches[url].insert(reply_blocks)
                if index >= warm:
                    load[url] += 1
                    hits += hit
                    queries += len(prompt.tokens)
                    if call.key is not None and call.key in last:
                        follow_ups += 1
                        same += last[call.key] == url
                if call.key is not None:
                    last[call.key] = url
            hit_rates.append(hits / queries)
            uncached.append(queries - hits)
            spreads.append(max(load.values()) / statistics.mean(load.values()))
            if follow_ups:
                agreements.append(same / follow_ups)
            if policy == "affinity" and draw == 0:
                bins = balls_into_bins(list(anchors.values()), engines)
        out.append(
            OfflineResult(
                policy,
                statistics.mean(hit_rates),
                statistics.mean(uncached),
                statistics.mean(spreads),
                max(spreads),
                statistics.mean(agreements) if agreements else None,
                min(agreements) if agreements else None,
                sum(x > GOAL_SPREAD for x in spreads),
                len(spreads),
                *(bins or (None, None)),
            )
        )
    return out


def run_offline(opts: Options, workloads: list[Workload], draws: int) -> None:
    settings = {k.removeprefix("GATEWAY_ROUTING__").lower(): v for k, v in opts.gateway_env.items()}
    print(f"offline replay, affinity with {settings or 'defaults'}, {draws} sets of URLs")
    for w in workloads:
        results = {r.policy: r for r in offline(w, settings, draws, opts)}
        rr = results["round_robin"].uncached
        for r in results.values():
            agree = (
                ""
                if r.agreement is None
                else (
                    f"  follow-ups same engine {r.agreement:6.1%} (worst {r.worst_agreement:.1%})"
                )
            )
            print(
                f"  {w.name:10} {r.policy:20} hit {r.hit_rate:6.1%}  uncached {r.uncached:9,.0f}"
                f" ({r.uncached / rr:.2f} of round robin)  max/mean requests {r.spread:.2f}"
                f" (worst {r.worst_spread:.2f}, over {GOAL_SPREAD} in {r.over} of {r.draws}"
                f" draws){agree}"
            )
            if r.bins_spread is not None and r.bins_over is not None:
                print(
                    f"  {w.name:10} {'':20} balls into bins (its anchors' measured requests"
                    f" thrown at random engines): max/mean {r.bins_spread:.2f},"
                    f" over {GOAL_SPREAD} in {r.bins_over:.0%} of throws"
                )
