"""Placements: where each anchor lives, chosen once, with the engines' expected loads even.

Rendezvous hashing alone spreads anchors evenly only on average: with a few dozen
anchors of uneven weight (conversations of 3 to 6 turns, templates of Zipf popularity)
one engine routinely gets 1.35x the mean number of requests and 1.6x in a bad draw
(measured over 12 sets of engine URLs on the bench workloads; docs/routing.md). The
in-flight bound (rendezvous.py) only acts once an engine is already queueing.

So an anchor is *placed* the first time this process sees it: on the first engine in
its rendezvous order whose load is within (1 + epsilon) x mean + 1, and it stays there
while the placement is remembered. Sticking matters: re-deciding per request would split
an anchor's requests between two engines and make both hold its prefix. Anchors placed
on their first choice are placed alike by every replica; the ones moved off a loaded
engine can land differently on replicas whose traffic differs (a larger epsilon moves
fewer, at the cost of balance: docs/routing.md).

The load compared is what the engine is about to carry, not what it carried:
- recent requests, with a weight that decays by 1/memory per request, so traffic of
  conversations that have ended is forgotten;
- plus a credit for each newly placed anchor: the mean requests per anchor of recent
  traffic, used up as its requests arrive. A burst of new conversations would otherwise
  be placed by their first turns alone, before the later turns that make most of their
  load (bench figures in docs/routing.md).

Both terms decay alike, so the credit of a conversation that ended early fades too.
Memory is bounded: `capacity` placements (least recently used dropped first), and the
mean requests per anchor over two generations of `window` requests, like hotspots.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_RESCALE = 1e100


@dataclass(slots=True)
class _Home:
    url: str
    # Requests this anchor is still expected to bring, times `Placements._unit`.
    credit: float = 0.0


class Placements:
    """Anchor -> engine URL, plus each engine's expected load. One event loop, no locks."""

    def __init__(
        self, epsilon: float = 0.0, window: int = 1024, capacity: int = 8192, memory: int = 160
    ) -> None:
        if epsilon < 0 or window <= 0 or capacity <= 0 or memory <= 1:
            raise ValueError("epsilon must be >= 0, window, capacity and memory positive")
        self._epsilon = epsilon
        self._window = window
        self._capacity = capacity
        self._homes: OrderedDict[bytes, _Home] = OrderedDict()
        # Decayed per engine: requests, and credit of its anchors. Stored multiplied by
        # `_unit`, which grows at each request instead of every value shrinking.
        self._decay = 1.0 / (1.0 - 1.0 / memory)
        self._unit = 1.0
        self._recent: dict[str, float] = {}
        self._credit: dict[str, float] = {}
        # Requests and placements over two generations of `window` requests: the mean
        # requests per anchor.
        self._requests = self._requests_previous = 0
        self._placed = self._placed_previous = 0

    def home(self, anchor: bytes, urls: Sequence[str]) -> int:
        """Index in `urls` (the anchor's rendezvous order) of the anchor's engine."""
        home = self._homes.get(anchor)
        if home is not None:
            try:
                index = urls.index(home.url)
            except ValueError:
                index = -1  # its engine left the pool: place it again
            if index >= 0:
                self._homes.move_to_end(anchor)
                return index
            self._use_credit(home)
        index = self._place(urls)
        requests = self._requests + self._requests_previous
        placed = self._placed + self._placed_previous
        # Its first request is counted as it is routed: the credit is for the rest.
        credit = max(0.0, requests / placed - 1.0) * self._unit if placed else 0.0
        self._placed += 1
        url = urls[index]
        self._credit[url] = self._credit.get(url, 0.0) + credit
        self._remember(anchor, _Home(url, credit))
        return index

    def adopt(self, anchor: bytes, url: str) -> None:
        """Give `anchor` the home `url` unless it has one: where a request carrying it
        went while a shorter anchor decided (Affinity.order)."""
        if anchor not in self._homes:
            self._remember(anchor, _Home(url))

    def count(self, url: str, anchor: bytes | None = None) -> None:
        """Count one request routed to `url`, for `anchor` (its credit shrinks by one)."""
        if self._requests >= self._window:
            self._requests_previous, self._requests = self._requests, 0
            self._placed_previous, self._placed = self._placed, 0
        self._requests += 1
        self._unit *= self._decay
        if self._unit > _RESCALE:
            self._rescale()
        self._recent[url] = self._recent.get(url, 0.0) + self._unit
        home = self._homes.get(anchor) if anchor is not None else None
        if home is not None:
            self._use_credit(home, self._unit)

    def load(self, url: str) -> float:
        """The engine's decayed recent requests plus the credit of its new anchors."""
        return (self._recent.get(url, 0.0) + self._credit.get(url, 0.0)) / self._unit

    def _place(self, urls: Sequence[str]) -> int:
        loads = [self.load(u) for u in urls]
        bound = (1.0 + self._epsilon) * sum(loads) / len(urls) + 1.0
        for i, load in enumerate(loads):
            if load <= bound:
                return i
        return 0

    def _remember(self, anchor: bytes, home: _Home) -> None:
        self._homes[anchor] = home
        self._homes.move_to_end(anchor)
        if len(self._homes) > self._capacity:
            _, dropped = self._homes.popitem(last=False)
            self._use_credit(dropped)

    def _use_credit(self, home: _Home, amount: float | None = None) -> None:
        """Take `amount` (scaled; all if None) of a home's credit off its engine."""
        used = home.credit if amount is None else min(amount, home.credit)
        if used > 0.0:
            home.credit -= used
            self._credit[home.url] = self._credit.get(home.url, 0.0) - used

    def _rescale(self) -> None:
        unit = self._unit
        self._recent = {u: v / unit for u, v in self._recent.items()}
        self._credit = {u: v / unit for u, v in self._credit.items()}
        for home in self._homes.values():
            home.credit /= unit
        self._unit = 1.0
