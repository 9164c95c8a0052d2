"""Fetch slots shared fairly between keys.

With one FIFO semaphore, one tenant's twelve requests to a slow origin queued ahead of
another tenant's single image and delayed it by ~3 s (measured). Here a freed slot goes
to the waiting owner holding the fewest slots (ties: the one that has waited longest,
and owners served in turn), so a newcomer waits for at most one slot to free up,
however deep another owner's queue is. Slots are never left idle while anyone waits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TypeVar

W = TypeVar("W")


class FairSlots:
    """`limit` slots; `acquire(owner)` waits for one, `release(owner)` gives it back.

    The caller must call `release` once for every `acquire` that returned. A waiter
    cancelled (by its timeout) leaves the queue, or is skipped by a release that comes
    first; one cancelled just after being handed a slot passes it on.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        # Slots held, by owner; an owner holding none has no entry.
        self.held: dict[str, int] = {}
        # Waiters by owner, owners in the order they started waiting (or were last served).
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    async def acquire(self, owner: str) -> None:
        if self.used < self.limit and not self._waiting:
            self._take(owner)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(owner)  # handed a slot, but no longer wanted
            else:
                leave(self._waiting, owner, waiter)
            raise

    def release(self, owner: str) -> None:
        held = self.held[owner] - 1
        if held:
            self.held[owner] = held
        else:
            del self.held[owner]
        self.used -= 1
        self._hand_over()

    def waiting(self, owner: str) -> int:
        queue = self._waiting.get(owner)
        return len(queue) if queue is not None else 0

    def _take(self, owner: str) -> None:
        self.held[owner] = self.held.get(owner, 0) + 1
        self.used += 1

    def _hand_over(self) -> None:
        held = self.held
        while self.used < self.limit and self._waiting:
            # min() keeps the first of equals: the owner waiting longest.
            owner = min(self._waiting, key=lambda o: held.get(o, 0))
            queue = self._waiting[owner]
            waiter = queue.popleft()
            if waiter.done():
                # Cancelled, and its task has not yet run to leave the queue: handing it
                # the slot would raise and leave the slot taken for good.
                if not queue:
                    del self._waiting[owner]
                continue
            del self._waiting[owner]
            if queue:
                self._waiting[owner] = queue  # to the back: equals take turns
            if waiter.done():
                # Cancelled (its timeout) but not yet resumed to leave the queue: it
                # takes nothing. Handing it the slot would raise InvalidStateError in
                # the releaser and leave the slot counted to it for good.
                continue
            self._take(owner)
            waiter.set_result(None)


def leave(queues: dict[str, deque[W]], owner: str, waiter: W) -> None:
    """Take `waiter` out of `owner`'s queue in `queues` if it is still there (a release
    may have skipped it already), and the queue out of `queues` once empty."""
    queue = queues.get(owner)
    if queue is None:
        return
    try:
        queue.remove(waiter)
    except ValueError:
        return
    if not queue:
        del queues[owner]
