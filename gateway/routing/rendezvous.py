"""Rendezvous (highest random weight) hashing of an anchor over engines, with a load bound.

Every engine gets the score H(anchor, engine url); engines sorted by descending score
form the anchor's order. The order depends only on the anchor and the set of URLs, so
every gateway process and replica computes the same one without sharing state, and
adding or removing an engine moves only the anchors whose first choice it was
(Thaler and Ravishankar, 1998).

The load bound is the one of consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, 2018): take the first engine in the order whose load is at most
(1 + epsilon) x mean + 1, so a hot anchor spills onto its second choice (which then
warms up for it) instead of queueing on the first without bound.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar


class _HasUrl(Protocol):
    @property
    def url(self) -> str: ...


class _HasLoad(Protocol):
    @property
    def in_flight(self) -> int: ...


U = TypeVar("U", bound=_HasUrl)
L = TypeVar("L", bound=_HasLoad)


def load_of(engine: _HasLoad) -> int:
    """An engine's load: its `load` when it has one (the pool's engines: requests in
    flight plus the engine's scraped queue), else its requests in flight."""
    load: int = getattr(engine, "load", engine.in_flight)
    return load


def busy_of(engine: _HasLoad) -> int:
    """An engine's requests now: its `busy` when it has one (the pool's engines: this
    process's in flight now plus the others' as scraped), else its requests in flight."""
    busy: int = getattr(engine, "busy", engine.in_flight)
    return busy


def score(anchor: bytes, url: str) -> int:
    """The engine's weight for `anchor`: stable across processes (blake2b, not hash())."""
    digest = hashlib.blake2b(anchor, digest_size=8, person=b"rendezvous")
    digest.update(url.encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest(), "big")


def _scored(anchor: bytes, engines: Sequence[U]) -> list[tuple[int, str, int]]:
    """(score, URL, index) of each engine, highest score first; ties (64-bit
    collisions) broken by URL."""
    return sorted(((score(anchor, e.url), e.url, i) for i, e in enumerate(engines)), reverse=True)


def rendezvous_order(anchor: bytes, engines: Sequence[U]) -> list[U]:
    """`engines`, highest score first; ties (64-bit collisions) broken by URL."""
    return [engines[i] for _, _, i in _scored(anchor, engines)]


def scored_order(anchor: bytes, engines: Sequence[U]) -> tuple[list[U], dict[str, int]]:
    """`rendezvous_order`, and the score of each engine's URL."""
    scored = _scored(anchor, engines)
    return [engines[i] for _, _, i in scored], {url: s for s, url, _ in scored}


def weighted_choice(scores: Mapping[str, int], weighted: Sequence[tuple[float, U]]) -> U:
    """Weighted rendezvous (Schindelhauer and Schomaker, 2005): each engine's share of
    the anchors is its weight's share of the total, and a small change of one weight
    moves only a small part of the anchors. `weighted` holds (weight >= 0, engine),
    `scores` the anchor's score of each engine's URL (`scored_order`)."""
    best: U | None = None
    top = -1.0
    for weight, engine in weighted:
        # A uniform number in (0, 1) from the engine's score; its key, w / -ln(u).
        u = (scores[engine.url] + 0.5) / 2.0**64
        key = weight / -math.log(u)
        if key > top:
            best, top = engine, key
    assert best is not None, "weighted_choice needs an engine"
    return best


def load_bound(engines: Sequence[_HasLoad], epsilon: float) -> float:
    """The most load an engine may carry and still take a new request."""
    if not engines:
        return 0.0
    mean = sum(load_of(e) for e in engines) / len(engines)
    return (1.0 + epsilon) * mean + 1.0


def first_within_bound(order: Sequence[L], epsilon: float) -> int:
    """Index in `order` of the first engine within the load bound.

    Some engine always qualifies (the least loaded carries at most the mean); 0 if the
    order is empty.
    """
    bound = load_bound(order, epsilon)
    for i, engine in enumerate(order):
        if load_of(engine) <= bound:
            return i
    return 0
