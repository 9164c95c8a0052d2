"""Hot candidates: which prefixes carried too much of this process's recent traffic.

A prefix that most requests share (a system prompt, few-shot examples, a popular
template) must not be the anchor, or every request lands on one engine
(production-stack #957, #990). A candidate is *hot* when, over a bounded decaying window
of recent requests, it

- carried more than 1/(divisor x N) of them (N healthy engines, divisor 4 by default:
  docs/routing.md),
- carried at least `min_count` of them (below that the share is noise; it also keeps a
  freshly started gateway from scattering the first few requests; a leading system
  prompt that forks is exempt, see `spread`), and
- *branches*: the requests carrying it continue differently somewhere after it.

A hot candidate's requests spread over divisor x N x share engines (`spread`), so
each of them takes at most 1/(divisor x N) of the traffic through that prefix.

The last condition keeps one conversation together however busy it is: its turns are
nested (each prompt is a prefix of the next), so nothing branches and a longer anchor
would route the same requests anyway. A system prompt shared by many conversations, or
an image asked many questions, branches, and is skipped for a longer candidate.

The window is two generations of `window` requests each: counts cover between `window`
and `2 x window` recent requests, updates are O(candidates) and memory is bounded.
The counts are per process. Replicas behind a load balancer each see a sample of the
same traffic, so they count nearly the same shares; `spread` is continuous in the share
so that a small difference moves few conversations (policy.py, docs/routing.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.anchors import Anchor, AnchorKind


class _Stat:
    __slots__ = ("branches", "count", "forks", "successor")

    def __init__(self) -> None:
        self.count = 0
        self.successor: bytes | None = None
        # `forks`: two requests carrying it had different next candidates;
        # `branches`: it forks, or something after it does.
        self.forks = False
        self.branches = False


_Generation = dict[bytes, _Stat]


class HotCandidates:
    """Counts of candidate anchors over recent requests. Not thread-safe: one event loop."""

    def __init__(self, *, window: int, divisor: float, min_count: int) -> None:
        if window <= 0 or divisor <= 0 or min_count < 1:
            raise ValueError("window and divisor must be positive, min_count at least 1")
        self._window = window
        self._divisor = divisor
        self._min_count = min_count
        self._current: _Generation = {}
        self._previous: _Generation = {}
        self._current_n = 0
        self._previous_n = 0

    def spread(self, anchor: Anchor, engines: int) -> float:
        """Over how many engines the requests carrying `anchor` should spread: 1 for a
        candidate that is not hot, else divisor x N x its share of recent requests (so
        each engine takes at most 1/(divisor x N) of the traffic through it), at most N.

        Continuous in the share, so two replicas that count slightly different shares
        (each sees its own half of the traffic) split only a sliver of the candidate's
        conversations differently (policy.py), not all of them at a threshold."""
        digest = anchor.digest
        cur = self._current.get(digest)
        prev = self._previous.get(digest)
        count = (cur.count if cur else 0) + (prev.count if prev else 0)
        if count < self._min_count and not (
            anchor.kind is AnchorKind.system and ((cur and cur.forks) or (prev and prev.forks))
        ):
            # A leading system prompt is written to be shared: it spreads as soon as two
            # conversations (or images) follow it, so the first turns of the first
            # conversations anchor where their later turns will, in every replica alike
            # (a replica that waited for `min_count` would send them to the prompt's
            # engine first). Questions about one image alone do not fork it.
            return 1.0
        if not ((cur and cur.branches) or (prev and prev.branches)):
            return 1.0
        total = self._current_n + self._previous_n
        engines = max(engines, 1)
        share = self._divisor * engines * count / total
        return min(max(share, 1.0), float(engines))

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
                    stat.forks = stat.branches = True
            if stat.branches:
                deepest_branch = i
            stats.append(stat)
        # A prefix branches when anything below it does (see the module docstring).
        for stat in stats[: max(deepest_branch, 0)]:
            stat.branches = True
