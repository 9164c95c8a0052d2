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

A hot candidate's requests spread over a stretch of the line of engines (policy.py)
in proportion to the traffic it leads (`interval`): the requests carrying it and no
hot candidate after it. The hot candidates lie end to end on the line, so a prompt is
copied to a second engine only where its traffic needs more than one engine's share,
and the engines' shares of the hot traffic come out even whatever each prompt hashes to.

The last condition keeps one conversation together however busy it is: its turns are
nested (each prompt is a prefix of the next), so nothing branches and a longer anchor
would route the same requests anyway. A system prompt shared by many conversations, or
an image asked many questions, branches, and is skipped for a longer candidate.

The window is two generations of `window` requests each: counts cover between `window`
and `2 x window` recent requests, updates are O(candidates) and memory is bounded.
The counts are per process. Replicas behind a load balancer each see a sample of the
same traffic, so they count nearly the same shares; the intervals are continuous in the
shares, so that a small difference moves few conversations (policy.py, docs/routing.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.anchors import Anchor, AnchorKind

# The intervals are laid out again after this many requests (or at once for a hot
# candidate not laid out yet): the shares move little between two layouts.
LAYOUT_EVERY = 16


class _Stat:
    __slots__ = ("branches", "count", "forks", "parent", "successor")

    def __init__(self) -> None:
        self.count = 0
        # The candidate before it (every request carrying it carries that one).
        self.parent: bytes | None = None
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
        # Candidates found hot since the last layout, and the layout: the hot
        # candidates' intervals of the line, as fractions of it, by digest.
        self._hot: dict[bytes, Anchor] = {}
        self._layout: dict[bytes, tuple[float, float]] = {}
        self._layout_engines = 0
        self._since_layout = 0

    def hot(self, anchor: Anchor, engines: int) -> bool:
        """Whether the requests carrying `anchor` spread (it is hot with N = `engines`)."""
        if self.spread(anchor, engines) > 1.0:
            self._hot[anchor.digest] = anchor
            return True
        return False

    def spread(self, anchor: Anchor, engines: int) -> float:
        """divisor x N x the share of recent requests that carried `anchor`, at least 1
        and at most N, when it is hot; else 1. Above 1, one engine would take more than
        1/(divisor x N) of all the traffic through it."""
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

    def interval(self, anchor: Anchor, engines: int) -> tuple[float, float]:
        """The stretch of the line of `engines` engines, as fractions of it, whose
        engines take the requests that the hot `anchor` leads: (start, length).

        The hot candidates lie end to end in digest order, each as long as the share of
        recent requests it leads (carried by it and by no hot candidate after it) over
        the share the hot candidates lead together, or over 1/divisor when that is
        more. While the hot traffic is under 1/divisor of all, a hot candidate spans
        divisor x N x its share engines (`spread`), each taking 1/(divisor x N) of the
        traffic; above that, the hot candidates fill the line once, each engine taking
        an equal part of the hot traffic. Every length is a function of the counts
        alone, as every replica counts them from its sample of the traffic."""
        place = self._layout.get(anchor.digest)
        if place is None or self._since_layout >= LAYOUT_EVERY or engines != self._layout_engines:
            self._hot[anchor.digest] = anchor
            self._lay_out(engines)
            place = self._layout[anchor.digest]
        return place

    def _count(self, digest: bytes) -> tuple[int, bytes | None]:
        cur = self._current.get(digest)
        prev = self._previous.get(digest)
        parent = cur.parent if cur else prev.parent if prev else None
        return (cur.count if cur else 0) + (prev.count if prev else 0), parent

    def _lay_out(self, engines: int) -> None:
        hot = {d: a for d, a in self._hot.items() if self.spread(a, engines) > 1.0}
        counts = {d: self._count(d) for d in hot}
        weights = {d: count for d, (count, _) in counts.items()}
        for count, parent in counts.values():
            if parent in weights:
                weights[parent] -= count  # those requests are led by the longer one
        for digest in self._hot:
            if digest not in hot:
                weights[digest] = 0  # asked for, but no longer hot
        # A hot candidate that leads nothing (every request carrying it carries a
        # longer hot one) is a point: its rare requests of its own go to one engine.
        requests = self._current_n + self._previous_n
        scale = max(sum(max(w, 0) for w in weights.values()), requests / self._divisor, 1.0)
        layout: dict[bytes, tuple[float, float]] = {}
        start = 0.0
        for digest in sorted(weights):
            weight = max(weights[digest], 0)
            layout[digest] = (start / scale, weight / scale)
            start += weight
        self._hot = hot
        self._layout = layout
        self._layout_engines = engines
        self._since_layout = 0

    def observe(self, anchors: Sequence[Anchor]) -> None:
        """Count one request that carried `anchors` (shortest first)."""
        if self._current_n >= self._window:
            self._previous, self._current = self._current, {}
            self._previous_n, self._current_n = self._current_n, 0
        self._current_n += 1
        self._since_layout += 1
        generation = self._current
        stats: list[_Stat] = []
        deepest_branch = -1
        last = len(anchors) - 1
        for i, anchor in enumerate(anchors):
            stat = generation.get(anchor.digest)
            if stat is None:
                stat = generation[anchor.digest] = _Stat()
            stat.count += 1
            if i and stat.parent is None:
                stat.parent = anchors[i - 1].digest
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
