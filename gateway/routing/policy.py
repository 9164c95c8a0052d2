"""Routing policies: given a request and the healthy engines, the order to try them in.

The contract between the proxy and the policies: the proxy hands a `RoutingRequest`
and the healthy engines; the policy returns every one of those engines, best first.
The proxy tries them in that order (failover walks the same order). A policy also
records its decision on the request (`anchor`, `first_choice`, `spilled`) for the log
line and the metrics.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from gateway.routing.hotspots import HotCandidates
from gateway.routing.keys import Anchor, candidate_anchors, session_anchor
from gateway.routing.placement import Placements
from gateway.routing.rendezvous import first_within_bound, load_of, rendezvous_order
from gateway.routing.settings import RoutingPolicy, RoutingSettings


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
    # A client-named session (from the `session_header` setting); overrides the anchor.
    session: str | None = None
    # Set by the policy. `anchor` is a hex digest (safe to log: it carries no prompt
    # text), `anchor_kind` the boundary it sits at, `first_choice` the URL of the
    # anchor's engine (where it hashes to, or where placement put it), `spilled`
    # whether the load bound moved the request off it.
    anchor: str | None = None
    anchor_kind: str | None = None
    first_choice: str | None = None
    spilled: bool = False


class Policy(Protocol):
    name: str

    def order(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]: ...


class RoundRobin:
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


class LeastLoaded:
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

    See keys.py for the anchors, hotspots.py for which one is taken and rendezvous.py
    for the order and the bound. Requests without a prompt spread round robin.
    """

    name = "affinity"

    def __init__(self, settings: RoutingSettings) -> None:
        self._settings = settings
        self._hot = HotCandidates(
            window=settings.hot_window,
            divisor=settings.hot_divisor,
            min_count=settings.hot_min_count,
        )
        self._placements: Placements | None = None
        if settings.placement:
            self._placements = Placements(
                epsilon=settings.placement_epsilon,
                window=settings.hot_window,
                capacity=settings.placement_capacity,
                memory=settings.placement_memory,
            )
        self._fallback = RoundRobin()

    def _anchors(
        self, request: RoutingRequest, engines: int
    ) -> tuple[Anchor | None, Anchor | None]:
        """The anchor of `request` given `engines` healthy engines (counted as seen),
        and the candidate right after it (None if it is the last)."""
        session = request.session
        body = request.body
        if session is None and self._settings.session_from_user and body is not None:
            user = body.get("user")
            session = user if isinstance(user, str) and user else None
        if session is not None:
            return session_anchor(body, session), None
        candidates = candidate_anchors(
            body,
            request.media,
            block_bytes=self._settings.prompt_block_bytes,
            max_candidates=self._settings.max_candidates,
        )
        if not candidates:
            return None, None
        chosen = self._hot.pick(candidates, engines)
        self._hot.observe(candidates)
        index = candidates.index(chosen) + 1
        return chosen, candidates[index] if index < len(candidates) else None

    def order(self, request: RoutingRequest, engines: Sequence[E]) -> list[E]:
        if not engines:
            return []
        anchor, successor = self._anchors(request, len(engines))
        if anchor is None:
            ordered = self._fallback.order(request, engines)
        else:
            ordered = rendezvous_order(anchor.digest, engines)
            request.anchor = anchor.digest.hex()
            request.anchor_kind = anchor.kind.value
            if self._placements is not None:
                home = self._placements.home(anchor.digest, [e.url for e in ordered])
                if home:
                    ordered.insert(0, ordered.pop(home))
                if successor is not None:
                    # Should this anchor turn hot (a system prompt everyone comes to
                    # share), the next candidate takes over; it starts where this
                    # request went, so a conversation begun before that stays put.
                    self._placements.adopt(successor.digest, ordered[0].url)
            request.first_choice = ordered[0].url
            index = first_within_bound(ordered, self._settings.load_epsilon)
            if index:
                ordered.insert(0, ordered.pop(index))
            request.spilled = ordered[0].url != request.first_choice
            if self._placements is not None:
                # Only requests with an anchor count: /v1/models polls and the like
                # differ between replicas and would make their placements disagree.
                self._placements.count(ordered[0].url, anchor.digest)
        return ordered


def make_policy(settings: RoutingSettings) -> Policy:
    if settings.policy is RoutingPolicy.round_robin:
        return RoundRobin()
    if settings.policy is RoutingPolicy.least_loaded:
        return LeastLoaded()
    return Affinity(settings)
