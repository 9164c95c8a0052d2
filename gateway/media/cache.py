"""A small cache of fetched, validated media (gateway/media/resolve.py builds the keys).

Bounded in bytes (least recently used entries go first) and in age, so a popular image
is fetched and decoded once per `cache_ttl` rather than once per request. A remote item
is keyed by its canonical URL, an inline one by the sha256 of its base64 text and its
declared type; every key also holds a digest of the media settings, and, when the
deployment isolates tenants (`payload.cache_isolation`), the tenant's namespace. The
cache never widens what the policy allows: a URL is checked before it is looked up.

Each entry is charged the bytes it holds (the caller says how many: the validated bytes
and the URL text built from them), and entries past their age are swept on every `put`,
so the bound is what the cache really holds, not what it last looked at.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    value: V
    size: int
    expires: float


class MediaCache(Generic[V]):
    def __init__(
        self, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_bytes = max_bytes
        self._ttl = ttl
        self._clock = clock
        # Least recently used first (the eviction order).
        self._entries: OrderedDict[str, _Entry[V]] = OrderedDict()
        # Oldest first (the expiry order: every entry lives the same `ttl`, so the order
        # of insertion is the order of expiry).
        self._ages: OrderedDict[str, float] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """What the entries held are charged, together."""
        return self._bytes

    def get(self, key: str) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    def put(self, key: str, value: V, size: int) -> None:
        """Keeps `value`, charged `size` bytes (what it holds in memory)."""
        now = self._clock()
        self._sweep(now)
        if self._ttl <= 0 or size > self._max_bytes:
            return
        if key in self._entries:
            self._remove(key)
        expires = now + self._ttl
        self._entries[key] = _Entry(value, size, expires)
        self._ages[key] = expires
        self._bytes += size
        while self._bytes > self._max_bytes:
            self._remove(next(iter(self._entries)))

    def _sweep(self, now: float) -> None:
        while self._ages:
            key, expires = next(iter(self._ages.items()))
            if expires > now:
                return
            self._remove(key)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        del self._ages[key]
        self._bytes -= entry.size
