"""`Budget`: the line image decodes wait in for their bytes and a thread, shared fairly
between owners (keys).

A decode takes its cost (bytes) and one of `threads` threads before it starts and gives
both back when it ends. A single first-come-first-served line would queue one key's 8
decode-heavy images per request ahead of another key's small image (in the soak, the p50
of a chat with one image: 1,044 ms against 77 ms; docs/facts.md, "Media memory"). Here,
as for fetch slots (gateway/media/slots.py), the next grant goes to the waiting owner
holding the fewest bytes (ties: the one waiting longest; owners served take turns);
within an owner, in arrival order. Bytes rather than decodes running: a decode's bytes
and its time both grow with its pixels, so the owner holding least is the one using least
of the line.

No starvation: if the chosen waiter does not fit yet (too few bytes free), nobody is
served until it does, not even a waiter that would fit; otherwise a stream of small
decodes would keep a large one waiting forever. The choice is made again at each release
and arrival, so an owner holding less than the chosen one's (a newcomer, or one whose
decodes ended) may go first; but once the large decode's owner holds nothing, each owner
ahead of it among equals goes before it at most once (served, it holds something, and
moves behind it), and no other does.

A waiter that is cancelled (a timeout is a cancellation) leaves the line, and one whose
share was granted before it resumed gives the share back: no path loses budget.
"""

from __future__ import annotations

import asyncio
from collections import deque

from gateway.media.slots import leave


class _Waiter:
    __slots__ = ("amount", "granted")

    def __init__(self, amount: int, granted: asyncio.Future[None]) -> None:
        self.amount = amount
        self.granted = granted


class Budget:
    """`capacity` units (bytes) and `threads` grants at once, handed out fairly between
    owners. The caller must `release(amount, owner)` once for every `acquire` that
    returned. Not thread-safe: use it from one event loop."""

    def __init__(self, capacity: int, threads: int) -> None:
        if capacity <= 0 or threads <= 0:
            raise ValueError("a budget needs a positive capacity and thread count")
        self.capacity = capacity
        self.available = capacity
        self.threads = threads
        self.running = 0
        # Bytes held, by owner; an owner holding none has no entry.
        self.held: dict[str, int] = {}
        # Waiters by owner, owners in the order they started waiting (or were last served).
        self._waiting: dict[str, deque[_Waiter]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    async def acquire(self, amount: int, owner: str) -> None:
        """Wait until `amount` and a thread are free and it is `owner`'s turn."""
        if not 0 < amount <= self.capacity:
            raise ValueError("an amount must be positive and at most the whole budget")
        if not self._waiting and self._fits(amount):
            self._take(amount, owner)
            return
        waiter = _Waiter(amount, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(owner, deque()).append(waiter)
        self._serve()  # an owner holding less than the one blocking the line goes first
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(amount, owner)  # granted while we were being cancelled
            else:
                leave(self._waiting, owner, waiter)
                self._serve()  # it may have been the one that held others back
            raise

    def release(self, amount: int, owner: str) -> None:
        held = self.held.get(owner, 0) - amount
        if held < 0 or self.running <= 0:
            raise RuntimeError("budget released more than was acquired")
        if held:
            self.held[owner] = held
        else:
            del self.held[owner]
        self.available += amount
        self.running -= 1
        self._serve()

    def _fits(self, amount: int) -> bool:
        return amount <= self.available and self.running < self.threads

    def _take(self, amount: int, owner: str) -> None:
        self.available -= amount
        self.running += 1
        self.held[owner] = self.held.get(owner, 0) + amount

    def _serve(self) -> None:
        held = self.held
        while self._waiting:
            # min() keeps the first of equals: the owner waiting longest.
            owner = min(self._waiting, key=lambda o: held.get(o, 0))
            queue = self._waiting[owner]
            if queue[0].granted.done():
                # Cancelled, and its task has not yet run to leave the line.
                leave(self._waiting, owner, queue[0])
                continue
            if not self._fits(queue[0].amount):
                return  # nobody is served out of turn (no starvation)
            del self._waiting[owner]
            waiter = queue.popleft()
            if queue:
                self._waiting[owner] = queue  # to the back: equals take turns
            self._take(waiter.amount, owner)
            waiter.granted.set_result(None)
