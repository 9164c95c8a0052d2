"""Engine errors per key: a key whose requests keep failing at the engine is throttled,
not the engine.

A request can fail at the engine by its own doing: vLLM answers 501 to a route its
model does not serve (/v1/systemone on every architecture but six) and 500 to some
inputs, and a long enough generation outlasts `timeouts.first_byte`. Those failures do
not eject the engine on one key's account (pool.py, `failed`); they count here, per key
name, in windows aligned to multiples of `routing.key_errors_window` since the
epoch (so every process and replica counts the same window). Once a key has
`routing.key_errors` of them in the current window, each request of that key is
answered 429 `too_many_engine_errors` before it reaches an engine, with Retry-After the
seconds to the window's end.

With a store (`SharedCount`, gateway/store/failures.py) the count is the larger of the
store's, across all processes and replicas, and this process's own; the store is asked
on a failure only, so a process learns that a key is over the limit at that key's
next failure in it. Without one, each process counts alone: a key gets up to
`key_errors` failures per window from each process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.access.windows import SharedCount, WindowCounts
from gateway.errors import TooManyEngineErrors

# Keys counted at once; past it, the one counted longest ago goes. Keys are configured,
# so this bounds nothing an attacker controls; it keeps a key file of any size cheap.
MAX_TRACKED = 16_384
# The store counts these under the unit "key:<name>", apart from client addresses.
UNIT_PREFIX = "key:"


class KeyErrors:
    """Counts engine failures (5xx answers, timeouts) per key name and throttles a key
    past `limit` in a window of `window` seconds."""

    def __init__(
        self,
        limit: int,
        window: float,
        *,
        logger: Any,
        shared: SharedCount | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.counts = WindowCounts(
            limit, window, shared=shared, clock=clock, max_tracked=MAX_TRACKED
        )
        self._log = logger

    def check(self, key: str | None) -> None:
        """Raise TooManyEngineErrors when `key` is throttled in the current window."""
        if key is None:
            return
        counts = self.counts
        entry = counts.over(key)
        if entry is None:
            return
        seconds = counts.retry_after(entry)
        if not entry.logged:
            entry.logged = True
            self._log.warning(
                "key_engine_errors_throttled",
                key=key,
                errors=entry.count,
                window=counts.window,
                retry_after=seconds,
            )
        raise TooManyEngineErrors(
            f"Too many of this key's requests failed at the engine; retry in {seconds} s.",
            retry_after=seconds,
        )

    async def failed(self, key: str | None) -> None:
        """Count a failure at the engine (a 5xx, a timeout) of a request of `key` (None:
        a caller without a key, not counted)."""
        if key is None:
            return
        await self.counts.add(key, UNIT_PREFIX + key)
