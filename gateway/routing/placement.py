"""Placements: where each anchor lives, chosen once, with the engines' recent shares even.

Rendezvous hashing alone spreads anchors evenly only on average: with a few dozen
anchors of uneven weight (conversations of 3 to 6 turns, templates of Zipf popularity)
one engine routinely gets 1.35x the mean number of requests and 1.6x in a bad draw
(measured over 12 sets of engine URLs on the bench workloads; docs/routing.md). The
in-flight bound (rendezvous.py) only acts once an engine is already queueing.

So an anchor is *placed* the first time this process sees it: on the first engine in
its rendezvous order whose share of this process's recent requests is within
(1 + epsilon) x mean + 1, and it stays there while the placement is remembered. Sticking
matters: re-deciding per request would split an anchor's requests between two engines
and make both hold its prefix. Most anchors are placed on their first choice, which
every replica computes alike; only anchors whose first choice was over its share can
differ between replicas whose traffic differs.

Memory is bounded: `capacity` placements (least recently used dropped first) and the
request shares over two generations of `window` requests, like hotspots.py.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence


class Placements:
    """Anchor -> engine URL, plus recent requests per engine. One event loop, no locks."""

    def __init__(self, epsilon: float = 0.2, window: int = 1024, capacity: int = 8192) -> None:
        if epsilon < 0 or window <= 0 or capacity <= 0:
            raise ValueError("epsilon must be >= 0, window and capacity positive")
        self._epsilon = epsilon
        self._window = window
        self._capacity = capacity
        self._homes: OrderedDict[bytes, str] = OrderedDict()
        self._current: Counter[str] = Counter()
        self._previous: Counter[str] = Counter()
        self._current_n = 0

    def home(self, anchor: bytes, urls: Sequence[str]) -> int:
        """Index in `urls` (the anchor's rendezvous order) of the anchor's engine."""
        url = self._homes.get(anchor)
        if url is not None:
            try:
                index = urls.index(url)
            except ValueError:
                index = -1  # its engine left the pool: place it again
            if index >= 0:
                self._homes.move_to_end(anchor)
                return index
        index = self._place(urls)
        self._homes[anchor] = urls[index]
        self._homes.move_to_end(anchor)
        if len(self._homes) > self._capacity:
            self._homes.popitem(last=False)
        return index

    def adopt(self, anchor: bytes, url: str) -> None:
        """Give `anchor` the home `url` unless it has one: where a request carrying it
        went while a shorter anchor decided (Affinity.order)."""
        if anchor not in self._homes:
            self._homes[anchor] = url
            if len(self._homes) > self._capacity:
                self._homes.popitem(last=False)

    def _share(self, url: str) -> int:
        return self._current[url] + self._previous[url]

    def _place(self, urls: Sequence[str]) -> int:
        shares = [self._share(u) for u in urls]
        bound = (1.0 + self._epsilon) * sum(shares) / len(urls) + 1.0
        for i, share in enumerate(shares):
            if share <= bound:
                return i
        return 0

    def count(self, url: str) -> None:
        """Count one request routed to `url`."""
        if self._current_n >= self._window:
            self._previous, self._current = self._current, Counter()
            self._current_n = 0
        self._current[url] += 1
        self._current_n += 1
