"""Failed authentications per client address, counted in the store for every replica.

A window is aligned to the epoch (its index is floor(now / window)), so every process
counts into the same key without agreeing on anything but the time. Key:

    <prefix>:auth:<window seconds>:<window index>:<client address>   a count; expires
                                                                      after its window
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gateway.store.client import StoreClient

# KEYS: the count. ARGV: its TTL (ms). The TTL is set with the first failure, so a
# count never outlives its window.
COUNT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return n
"""


class SharedFailures:
    """Failed authentications per client address and window, shared by all replicas."""

    def __init__(self, client: StoreClient, clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self._prefix = f"{client.prefix}:auth:"
        self._script = client.script(COUNT)
        self._clock = clock

    async def add(self, client: str, window: float) -> int | None:
        """Count a failed authentication from `client` in the current window of
        `window` seconds; the window's count so far, or None when the store is not
        usable (the caller counts in its own process then)."""
        if not self.client.usable():
            return None
        index = math.floor(self._clock() / window)
        key = f"{self._prefix}{window:g}:{index}:{client}"
        # Until the window's end, and a second for the clocks of other replicas.
        ttl = str(math.ceil(((index + 1) * window - self._clock() + 1) * 1000))

        async def call() -> int:
            return int(await self._script(keys=[key], args=[ttl]))

        return await self.client.attempt(call)
