"""`Budget`: a weighted semaphore, first come first served, for the bytes decodes hold.

A decode takes its cost from the budget before it starts and gives it back when it ends.
Waiters are served strictly in arrival order: a large decode at the head of the line is
not overtaken by smaller ones behind it (which would starve it). A waiter that is
cancelled (a timeout is a cancellation) leaves the line, and one whose share was
granted before it resumed gives the share back, and one cancelled before a release
reaches it is skipped by that release: no path loses budget.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class _Waiter:
    __slots__ = ("amount", "granted")

    def __init__(self, amount: int, granted: asyncio.Future[None]) -> None:
        self.amount = amount
        self.granted = granted


class Budget:
    """`capacity` units (bytes), handed out in arrival order. Not thread-safe: use it
    from one event loop."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("a budget needs a positive capacity")
        self.capacity = capacity
        self.available = capacity
        self._line: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._line)

    async def acquire(self, amount: int) -> None:
        """Wait until `amount` is free and every earlier waiter has been served."""
        if amount > self.capacity:
            raise ValueError("more than the whole budget")
        if not self._line and amount <= self.available:
            self.available -= amount
            return
        waiter = _Waiter(amount, asyncio.get_running_loop().create_future())
        self._line.append(waiter)
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(amount)  # granted while we were being cancelled
            else:
                # Still in line, unless a release in between skipped it (`_serve`).
                with contextlib.suppress(ValueError):
                    self._line.remove(waiter)
                self._serve()  # it may have been the head that held others back
            raise

    def release(self, amount: int) -> None:
        self.available += amount
        if self.available > self.capacity:
            raise RuntimeError("budget released more than was acquired")
        self._serve()

    def _serve(self) -> None:
        line = self._line
        while line:
            waiter = line[0]
            if waiter.granted.done():
                # Cancelled (its timeout, its client gone) but not yet resumed to leave
                # the line: it takes nothing. Granting it raised InvalidStateError in the
                # middle of a release, and the share it had been counted was lost for
                # good (a 500, then 503 media_busy for everyone once enough had leaked).
                line.popleft()
                continue
            if waiter.amount > self.available:
                return
            line.popleft()
            self.available -= waiter.amount
            waiter.granted.set_result(None)
