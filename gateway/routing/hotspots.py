"""Hot candidates: which prefixes carried too much of this process's recent traffic.

A prefix that most requests share (a system prompt, few-shot examples, a popular
template) must not be the anchor, or every request lands on one engine
(production-stack #957, #990). A candidate is *hot* when, over a bounded decaying window
of recent requests, it

- carried more than 1/(divisor x N) of them (N healthy engines, divisor 2 by default:
  docs/facts.md, "Routing key"),
- carried at least `min_count` of them (below that the share is noise; it also keeps a
  freshly started gateway from scattering the first few requests), and
- *branches*: the requests carrying it continue differently somewhere after it.

The last condition keeps one conversation together however busy it is: its turns are
nested (each prompt is a prefix of the next), so nothing branches and a longer anchor
would route the same requests anyway. A system prompt shared by many conversations, or
an image asked many questions, branches, and is skipped for a longer candidate.

The window is two generations of `window` requests each: counts cover between `window`
and `2 x window` recent requests, updates are O(candidates) and memory is bounded.
The state is per process: replicas agree on the engine whenever they agree on which
candidates are hot, which holds for any traffic mix that is not on the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.keys import Anchor


class _Stat:
    __slots__ = ("branches", "count", "successor")

    def __init__(self) -> None:
        self.count = 0
        self.successor: bytes | None = None
        self.branches = False


_Generation = dict[bytes, _Stat]


class HotCandidates:
    """Counts of candidate anchors over recent requests. Not thread-safe: one event loop."""

    def __init__(self, window: int = 1024, divisor: float = 2.0, min_count: int = 8) -> None:
        if window <= 0 or divisor <= 0 or min_count < 1:
            raise ValueError("window and divisor must be positive, min_count at least 1")
        self._window = window
        self._divisor = divisor
        self._min_count = min_count
        self._current: _Generation = {}
        self._previous: _Generation = {}
        self._current_n = 0
        self._previous_n = 0

    def is_hot(self, digest: bytes, engines: int) -> bool:
        cur = self._current.get(digest)
        prev = self._previous.get(digest)
        count = (cur.count if cur else 0) + (prev.count if prev else 0)
        if count < self._min_count:
            return False
        total = self._current_n + self._previous_n
        if count * self._divisor * max(engines, 1) <= total:
            return False
        return bool((cur and cur.branches) or (prev and prev.branches))

    def pick(self, anchors: Sequence[Anchor], engines: int) -> Anchor:
        """The shortest candidate that is not hot; the longest one if all are."""
        for anchor in anchors[:-1]:
            if not self.is_hot(anchor.digest, engines):
                return anchor
        return anchors[-1]

    def observe(self, anchors: Sequence[Anchor]) -> None:
        """Count one request that carried `anchors` (shortest first)."""
        if self._current_n >= self._window:
            self._previous, self._current = self._current, {}
            self._previous_n, self._current_n = self._current_n, 0
        self._current_n += 1
        generation = self._current
        stats: list[_Stat] = []
        deepest_branch = -1
        last = len(anchors) - 1
        for i, anchor in enumerate(anchors):
            stat = generation.get(anchor.digest)
            if stat is None:
                stat = generation[anchor.digest] = _Stat()
            stat.count += 1
            if i < last:
                successor = anchors[i + 1].digest
                if stat.successor is None:
                    stat.successor = successor
                elif stat.successor != successor:
                    stat.branches = True
            if stat.branches:
                deepest_branch = i
            stats.append(stat)
        # A prefix branches when anything below it does (see the module docstring).
        for stat in stats[: max(deepest_branch, 0)]:
            stat.branches = True
