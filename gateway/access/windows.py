"""Counts per unit (a client address, a key name) in windows aligned to multiples of the
window since the epoch, so every process and replica counts the same window without
agreeing on anything but the time. With a store (`SharedCount`) a unit's count is the
larger of the store's, across all processes and replicas, and this process's own; the
store is asked on a count only.

Memory is bounded: at most `max_tracked` units at once; past it, the unit counted
longest ago (its window the oldest) goes and counts from zero if it comes back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol


class SharedCount(Protocol):
    """Counts shared by every process and replica (through the store)."""

    async def add(self, client: str, window: float) -> int | None:
        """Count one of `client` in the current window (`window` seconds long, aligned
        to the epoch) and return that window's count across all replicas; None when the
        store cannot be used (the caller counts locally)."""
        ...


class Window:
    __slots__ = ("count", "logged", "start")

    def __init__(self, start: float) -> None:
        self.start = start
        self.count = 0
        # Whether the unit's throttling was logged in this window (once per window).
        self.logged = False


class WindowCounts:
    """A unit's count in the current window, against `limit`."""

    def __init__(
        self,
        limit: int,
        window: float,
        *,
        shared: SharedCount | None,
        clock: Callable[[], float],
        max_tracked: int,
    ) -> None:
        self.limit = limit
        self.window = window
        self.shared = shared
        self.clock = clock
        self.max_tracked = max_tracked
        # Unit -> its current window; insertion order is the order counted.
        self.windows: dict[str, Window] = {}

    def _start(self, now: float) -> float:
        return math.floor(now / self.window) * self.window

    def over(self, unit: str) -> Window | None:
        """`unit`'s window when it has reached `limit` in the current one, else None."""
        windows = self.windows
        if not windows:
            return None
        entry = windows.get(unit)
        if entry is None or entry.count < self.limit:
            return None
        return entry if entry.start == self._start(self.clock()) else None

    async def add(self, unit: str, shared_unit: str) -> Window:
        """Count one of `unit` (in the store as `shared_unit`); its current window."""
        start = self._start(self.clock())
        windows = self.windows
        entry = windows.get(unit)
        if entry is None or entry.start != start:
            if entry is not None:
                del windows[unit]
            elif len(windows) >= self.max_tracked:
                del windows[next(iter(windows))]
            entry = windows[unit] = Window(start)
        entry.count += 1
        if self.shared is not None:
            total = await self.shared.add(shared_unit, self.window)
            if total is not None and total > entry.count:
                entry.count = total
        return entry

    def retry_after(self, entry: Window) -> int:
        """Whole seconds to the end of `entry`'s window, at least 1."""
        return max(1, math.ceil(entry.start + self.window - self.clock()))
