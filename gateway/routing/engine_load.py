"""Reading an engine's own load from its Prometheus text (`GET /metrics`).

Only three gauges and two counters are read, by a byte scan instead of a full
exposition parser: vLLM's /metrics carries every histogram bucket of every model (tens
of kilobytes), and this runs on the event loop that forwards requests.
"""

from __future__ import annotations

import math
from typing import NamedTuple

RUNNING = b"vllm:num_requests_running"
WAITING = b"vllm:num_requests_waiting"
KV_USAGE = b"vllm:kv_cache_usage_perc"
# Prompt tokens looked up in the prefix cache, and those found: cumulative counters,
# their difference the tokens the engine prefilled (recomputed), partial blocks and
# evicted ones included.
QUERIES = b"vllm:prefix_cache_queries_total"
HITS = b"vllm:prefix_cache_hits_total"
# The most requests a count is read as: finite samples can add up past a float's range
# (two of 1e308), and no engine holds more.
MAX_REQUESTS = 1_000_000
# Likewise the most tokens a counter is read as.
MAX_TOKENS = 1e15


class EngineLoad(NamedTuple):
    # Requests queued in the engine, from every gateway replica (summed over the
    # engine's label sets: data-parallel ranks and models).
    waiting: int
    # Fraction of KV cache blocks in use, 0 to 1 (the highest over label sets).
    kv_cache_usage: float
    # Requests in the engine's running batch, from every replica (summed likewise).
    running: int = 0
    # Prompt tokens the engine has recomputed since it started (its prefix cache's
    # queries less its hits, summed over label sets); None when it does not say.
    recomputed: float | None = None


def _samples(text: bytes, name: bytes) -> list[float]:
    """Values of every sample of `name` (any labels). Comment lines never match: a
    sample starts a line, and the character after its name is `{` or a space."""
    values: list[float] = []
    needle = b"\n" + name
    pos = text.find(needle)
    while pos != -1:
        after = pos + len(needle)
        end = text.find(b"\n", after)
        line = text[after : len(text) if end == -1 else end]
        if line[:1] in (b"{", b" "):
            # The value follows the label set; an optional timestamp follows the value.
            fields = line[line.rfind(b"}") + 1 :].split()
            try:
                value = float(fields[0]) if fields else math.nan
            except ValueError:
                value = math.nan
            if math.isfinite(value) and value >= 0:
                values.append(value)
        pos = text.find(needle, after)
    return values


def parse_load(text: bytes) -> EngineLoad | None:
    """The engine's load, or None when the text carries neither gauge (not a vLLM)."""
    text = b"\n" + text  # so the first line matches like every other
    waiting = _samples(text, WAITING)
    usage = _samples(text, KV_USAGE)
    running = _samples(text, RUNNING)
    if not waiting and not usage and not running:
        return None
    queries = _samples(text, QUERIES)
    hits = _samples(text, HITS)
    recomputed = None
    if queries:
        recomputed = min(max(0.0, sum(queries) - sum(hits)), MAX_TOKENS)
    return EngineLoad(
        int(min(sum(waiting), MAX_REQUESTS)),
        min(max(usage, default=0.0), 1.0),
        int(min(sum(running), MAX_REQUESTS)),
        recomputed,
    )


class RecentTokens:
    """An engine's recently recomputed prompt tokens: the increments of its cumulative
    counter (`EngineLoad.recomputed`), each decaying with time constant `tau` seconds
    from when it was read (the shared store's `store_decay`). The first reading is the
    baseline: an engine's history before this process saw it counts nothing. A counter
    that goes back (the engine restarted) counts from zero."""

    __slots__ = ("_at", "_counter", "_tau", "_value")

    def __init__(self) -> None:
        self._counter: float | None = None
        self._value = 0.0
        self._at = 0.0
        self._tau = 1.0

    def observe(self, counter: float, now: float, tau: float) -> None:
        if self._counter is None:
            self._counter, self._at, self._tau = counter, now, tau
            return
        grown = counter - self._counter if counter >= self._counter else counter
        self._value = self.value(now) + grown
        self._counter, self._at, self._tau = counter, now, tau

    @property
    def known(self) -> bool:
        """Whether a counter was read (an engine without one has no figure)."""
        return self._counter is not None

    def value(self, now: float) -> float:
        if self._value == 0.0:
            return 0.0
        return self._value * math.exp(-max(0.0, now - self._at) / self._tau)
