"""Routing policies: given a request and the healthy engines, the order to try them in.

The contract between the proxy and the policies: the proxy hands a `RoutingRequest`
and the healthy engines to `choose`, and gets a `Decision`: every one of those engines,
best first, and what decided it (`anchor`, `first_choice`, `spilled`) for the log line
and the metrics. The proxy tries them in that order (failover walks the same order).
A policy with a shared placement store (store.py; affinity only) consults it inside
`choose`; `order` is the same decision without the store, for the bench and the tests.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from gateway.routing.anchors import Anchor, AnchorKind, candidate_anchors, session_anchor
from gateway.routing.engine_load import RecentTokens
from gateway.routing.hotspots import HotCandidates
from gateway.routing.rendezvous import (
    busy_of,
    first_within_bound,
    load_of,
    rendezvous_order,
    score,
    scored_order,
    weighted_choice,
)
from gateway.routing.settings import RoutingPolicy, RoutingSettings
from gateway.routing.store import PlacementStore
from gateway.store.client import StoreClient

# The anchor whose rendezvous order is the line of engines (`Affinity.narrow`).
_LINE = b"hot candidates' line of engines"


@functools.lru_cache(maxsize=64)
def _line(urls: tuple[str, ...]) -> tuple[str, ...]:
    """The line of engines: their URLs by a hash of each, so every replica and worker
    lays it alike (and the same set of engines, asked again, is not sorted again)."""
    return tuple(sorted(urls, key=lambda url: (score(_LINE, url), url), reverse=True))


class EngineView(Protocol):
    """What a policy may read of an engine (the pool's engine objects satisfy it)."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


E = TypeVar("E", bound=EngineView)


@dataclass
class RoutingRequest:
    path: str
    # The parsed JSON body after inspection (None for bodiless or multipart requests).
    body: dict[str, Any] | None = None
    # Content digests of the validated media items, by their path in the body.
    media: Mapping[str, str] = field(default_factory=dict)
    key_name: str | None = None
    # The digest of the request's key (the shared store counts its anchors per key).
    key_digest: bytes | None = None
    # A client-named session (from the `session_header` setting); overrides the anchor.
    session: str | None = None
    # Every engine serving the request's model, healthy or not: the line affinity lays
    # its hot prompts over (None: the engines it is given). With the healthy ones
    # alone, an engine failing its checks would shift every hot prompt's engines.
    line: Sequence[EngineView] | None = None
    # Set by the policy. `anchor` is a hex digest (safe to log: it carries no prompt
    # text), `anchor_kind` the boundary it sits at, `first_choice` the URL of the
    # anchor's engine (where it hashes to), `spilled` whether the load bound moved the
    # request off it.
    anchor: str | None = None
    anchor_kind: str | None = None
    first_choice: str | None = None
    spilled: bool = False


@dataclass(frozen=True, slots=True)
class Decision(Generic[E]):
    """A policy's answer for one request: `engines` best first (every engine it was
    given), and the request's decision fields as the policy set them."""

    engines: list[E]
    anchor: str | None = None
    anchor_kind: str | None = None
    first_choice: str | None = None
    spilled: bool = False

    @classmethod
    def of(cls, request: RoutingRequest, engines: list[E]) -> Decision[E]:
        return cls(
            engines, request.anchor, request.anchor_kind, request.first_choice, request.spilled
        )


class Policy(Protocol):
    name: str
    # The shared placement store `choose` consults (None: none is configured); the
    # app watches it and the lifespan closes it.
    store: PlacementStore | None

    async def choose(self, request: RoutingRequest, engines: Sequence[E]) -> Decision[E]:
        """The order to try `engines` in for `request`, and why."""
        ...


class Stateless:
    """A policy without a store: `choose` is `order`."""

    store: PlacementStore | None = None

    def order(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]:
        raise NotImplementedError

    async def choose(self, request: RoutingRequest, engines: Sequence[E]) -> Decision[E]:
        return Decision.of(request, self.order(request, engines))


class RoundRobin(Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def order(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]:
        if not engines:
            return []
        start = next(self._counter) % len(engines)
        ordered = [*engines[start:], *engines[:start]]
        request.first_choice = ordered[0].url
        return ordered


class LeastLoaded(Stateless):
    """Least load first (requests in flight, plus the engine's queue when scraped); ties
    go round robin, so an idle pool still spreads."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._rotation = RoundRobin()

    def order(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]:
        if not engines:
            return []
        rotated = self._rotation.order(request, engines)
        ordered = sorted(rotated, key=load_of)  # sorted() is stable
        request.first_choice = ordered[0].url
        return ordered


class Affinity:
    """Cache affinity: the request's anchor, rendezvous-hashed, within a load bound.

    Every replica and worker process decides alike: the engine is a function of the
    request's candidate anchors, their spreads (hotspots.py: counted per process, but
    from samples of the same traffic, and continuous in the share), the set of engine
    URLs, and for the load bound the engines' load as they report it (engine.py). No
    request history of this process moves an anchor. See anchors.py for the candidates
    and rendezvous.py for the order and the bound. Requests without a prompt spread
    round robin.
    """

    name = "affinity"

    def __init__(self, settings: RoutingSettings, store: PlacementStore | None = None) -> None:
        self._settings = settings
        self.store = store
        self._hot = HotCandidates(
            window=settings.hot_window,
            divisor=settings.hot_divisor,
            min_count=settings.hot_min_count,
        )
        self._fallback = RoundRobin()

    def _candidates(self, request: RoutingRequest) -> list[Anchor]:
        session = request.session
        body = request.body
        if session is None and self._settings.session_from_user and body is not None:
            user = body.get("user")
            session = user if isinstance(user, str) and user else None
        if session is not None:
            return [session_anchor(body, session, request.key_digest or b"")]
        return candidate_anchors(
            body,
            request.media,
            block_bytes=self._settings.prompt_block_bytes,
            max_candidates=self._settings.max_candidates,
        )

    def narrow(
        self,
        candidates: Sequence[Anchor],
        engines: Sequence[E],
        line: Sequence[EngineView] | None = None,
    ) -> tuple[Anchor, list[E], list[E]]:
        """The deciding anchor, the engines in order before the load bound, and the
        engines the anchor chose among (where the shared store may place it). Counts
        nothing.

        Without a hot candidate, the first candidate decides by its rendezvous order
        (a system prompt, a template, a conversation without one, an image). Else the
        candidate after the deepest hot one decides, on the line of engines (`_line`:
        N engines end to end, in an order every replica computes alike): the hot
        candidate owns an interval of it in proportion to the traffic it leads
        (hotspots.py), and the deciding candidate's hash picks the point in it. The
        line is laid over `line` when given (every engine serving the model, healthy or
        not): a point on an engine not among `engines` takes the deciding candidate's
        rendezvous order, so only that engine's requests move while it is out.

        A conversation under a shared system prompt: the prompt is hot, the first user
        message (never hot: its turns are nested) picks its point, the same for every
        turn. Four shared prompts over three engines: each owns three quarters of an
        engine's length, so each is on one engine or two, never all three, and the
        engines share the conversations evenly whatever the prompts' hashes. Two
        replicas whose counts differ by a little place only the requests whose points
        fall near an engine's boundary differently."""
        n = len(engines)
        last = len(candidates) - 1
        # A request whose first user message carries media never anchors on its leading
        # system prompt: the media is the costly part to recompute, and the same in
        # every turn and every question about it, so it decides from the first request
        # on, in every replica alike, whether or not this process has seen the prompt
        # fork yet (hotspots.py). A function of the request alone: replicas agree.
        media_first = any(a.kind is AnchorKind.media for a in candidates)
        first = -1
        hot = -1
        for i, anchor in enumerate(candidates):
            if media_first and anchor.kind is AnchorKind.system:
                continue
            if first < 0:
                first = i
            # Only a candidate that branches can be hot, and every prefix of one that
            # branches does: the first that is not hot ends the walk.
            if i == last or not self._hot.hot(anchor, n):
                break
            hot = i
        if hot < 0:
            anchor = candidates[first]
            ranked = rendezvous_order(anchor.digest, engines)
            return anchor, ranked, ranked
        anchor = candidates[hot + 1]
        start, length = self._hot.interval(candidates[hot], n)
        urls = _line(tuple(e.url for e in (line or engines)))
        size = len(urls)
        low = start * size
        high = min(low + length * size, size)
        healthy = {e.url: e for e in engines}
        covered: list[tuple[float, E]] = []
        # A point (a hot candidate that leads nothing) covers the engine it lies on,
        # the last one when it lies at the line's end.
        first_engine = min(int(low), size - 1)
        for j in range(first_engine, min(max(math.ceil(high), first_engine + 1), size)):
            engine = healthy.get(urls[j])
            if engine is not None:
                covered.append((min(high, j + 1.0) - max(low, float(j)), engine))
        ranked, scores = scored_order(anchor.digest, engines)
        if not covered:
            return anchor, ranked, ranked  # every engine of its interval is out
        chosen = weighted_choice(scores, covered)
        rest = [e for e in ranked if e is not chosen]
        choices = [chosen, *(e for _, e in covered if e is not chosen)]
        return anchor, [chosen, *rest], choices

    def order(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]:
        anchor, ordered, _, _ = self._decide(request, engines, count=True)
        return self._bound(request, anchor, ordered)

    def peek(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]:
        """What this process would decide for `request` on its counts as they are,
        counting nothing. `order` counts the request before deciding it, so for a
        request that makes a prefix hot the two differ; asked right after `order`, with
        the same engines and loads, `peek` returns `order`'s answer."""
        anchor, ordered, _, _ = self._decide(request, engines, count=False)
        return self._bound(request, anchor, ordered)

    async def choose(self, request: RoutingRequest, engines: Sequence[E]) -> Decision[E]:
        """`order`; with a shared store, the deciding anchor's engine is read from it,
        or placed there on the least busy of the engines the anchor chooses among, by
        what the store recorded and their load now (store.py). Without an answer from
        the store, `order`'s stateless choice."""
        return Decision.of(request, await self._place(request, engines))

    async def _place(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]:
        store = self.store
        if store is None or len(engines) < 2:
            return self.order(request, engines)
        anchor, ordered, choices, candidates = self._decide(request, engines, count=True)
        if anchor is None:
            return ordered
        url = await store.place(
            anchor.digest,
            [e.url for e in choices],
            request.key_digest,
            conversation_of(candidates, anchor),
            [busy_of(e) for e in choices],
            recomputed_of(choices),
        )
        if url is not None and url != ordered[0].url:
            for i, e in enumerate(ordered):
                if e.url == url:
                    ordered.insert(0, ordered.pop(i))
                    break
        return self._bound(request, anchor, ordered)

    def _decide(
        self, request: RoutingRequest, engines: Sequence[E], count: bool
    ) -> tuple[Anchor | None, list[E], list[E], list[Anchor]]:
        """`narrow` over the request's candidates, which it counts for the hot prefixes
        when `count` (a session's anchor is not counted): the decision `order`, `peek`
        and `choose` share, before the store and the load bound; and the candidates. A
        request without candidates (no prompt) gets no anchor and its final order: round
        robin when counting, the engines as given when not.

        A request is counted before it is decided, so it decides on what it shows: the
        second conversation under a system prompt is the one that forks it, and it is
        placed in the prompt's stretch of the line like every later one, not pinned to
        the engine of the first (hotspots.py, `spread`)."""
        if not engines:
            return None, [], [], []
        candidates = self._candidates(request)
        if not candidates:
            ordered = self._fallback.order(request, engines) if count else list(engines)
            return None, ordered, ordered, candidates
        if count and candidates[0].kind is not AnchorKind.session:
            self._hot.observe(candidates)
        anchor, ordered, choices = self.narrow(candidates, engines, request.line)
        return anchor, ordered, choices, candidates

    def _bound(self, request: RoutingRequest, anchor: Anchor | None, ordered: list[E]) -> list[E]:
        """Records the decision on the request, then applies the load bound; an order
        without an anchor (no prompt) is final."""
        if anchor is None:
            return ordered
        request.anchor = anchor.digest.hex()
        request.anchor_kind = anchor.kind.value
        request.first_choice = ordered[0].url
        index = first_within_bound(ordered, self._settings.load_epsilon)
        if index:
            ordered.insert(0, ordered.pop(index))
            request.spilled = True
        return ordered


def recomputed_of(engines: Sequence[EngineView]) -> list[float | None]:
    """Each engine's recently recomputed prompt tokens as its scrapes measured them
    (engine_load.py, `RecentTokens`); None for an engine whose counters were never read."""
    now = time.monotonic()
    found: list[float | None] = []
    for e in engines:
        recent: RecentTokens | None = getattr(e, "recomputed", None)
        found.append(recent.value(now) if recent is not None and recent.known else None)
    return found


def conversation_of(candidates: Sequence[Anchor], anchor: Anchor) -> bytes | None:
    """The digest of the request's first user message when a shorter candidate
    (`anchor`: a system prompt or an image not spread here) decides, else None. Its
    turns all carry it, whichever anchor decides in whichever replica: the shared store
    keeps a conversation where its first turn went by it (store.py)."""
    decided = False
    for candidate in candidates:
        if candidate is anchor:
            decided = True
        elif candidate.kind is AnchorKind.first_user:
            return candidate.digest if decided else None
    return None


def make_policy(settings: RoutingSettings, store: StoreClient | None = None) -> Policy:
    """The configured policy; affinity places through `store` when one is given (the
    top-level `store_url`; the other policies have nothing to place)."""
    if settings.policy is RoutingPolicy.round_robin:
        return RoundRobin()
    if settings.policy is RoutingPolicy.least_loaded:
        return LeastLoaded()
    return Affinity(settings, PlacementStore(store, settings) if store is not None else None)
