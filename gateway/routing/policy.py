"""Routing policies: given a request and the healthy engines, the order to try them in.

The contract between the proxy and the policies: the proxy hands a `RoutingRequest`
and the healthy engines; the policy returns every one of those engines, best first.
The proxy tries them in that order (failover walks the same order).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

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
    # Content hashes of the validated media items, in request order.
    media_hashes: list[str] = field(default_factory=list)
    key_name: str | None = None
    session: str | None = None


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
        return [*engines[start:], *engines[:start]]


def make_policy(settings: RoutingSettings) -> Policy:
    if settings.policy is RoutingPolicy.round_robin:
        return RoundRobin()
    # The affinity and least-loaded policies arrive with the routing issue (#5);
    # until then every policy setting routes round robin.
    return RoundRobin()
