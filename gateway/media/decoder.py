"""`Decoder`: the thread pool images are read and decoded on, and the budget of bytes
their decodes share (docs/media.md, "Media memory").

The pool has `media.decode_threads` threads whatever the host's core count: asyncio's
default executor has cores + 4, and on 2 cores six 160 MiB decodes at once on it take
the gateway to 990 MiB (bench/suites/decode_memory.py; docs/facts.md, "Media memory").
Decodes wait in the budget's line, fair between keys, for their bytes and a thread, so
the pool's own first-come-first-served queue never holds a decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from gateway.errors import MediaBusy
from gateway.media.budget import Budget
from gateway.media.settings import MediaSettings

P = ParamSpec("P")
T = TypeVar("T")


class Decoder:
    """Owns a thread pool: the owner must `aclose()` it (the app's lifespan does)."""

    def __init__(self, settings: MediaSettings) -> None:
        self.budget = Budget(settings.decode_budget_bytes, settings.decode_threads)
        self.wait = settings.decode_wait
        self._executor = ThreadPoolExecutor(
            settings.decode_threads, thread_name_prefix="media-decode"
        )

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn` on the pool, charged nothing (header reads: no pixel buffers).

        Outside the budget's line: it waits in the pool's queue, first come first served,
        for a thread (at most the decodes running, which the line caps at the pool's size,
        and the header reads queued before it); a decode granted meanwhile may wait
        behind the header reads queued, which are short.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def decode(
        self, cost: int, owner: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`fn` on the pool once `cost` bytes of the budget and a thread are had, in the
        line shared fairly between owners (keys; gateway/media/budget.py).

        Raises MediaBusy when they are not had within `decode_wait` seconds. The cost is
        given back when `fn` has finished on its thread, not when the caller stops
        waiting: a cancelled request's decode still holds its memory until it ends. A
        cost of 0 (depth `header`: nothing is decoded) runs as `run` does.
        """
        if cost <= 0:
            return await self.run(fn, *args, **kwargs)
        try:
            async with asyncio.timeout(self.wait):
                await self.budget.acquire(cost, owner)
        except TimeoutError:
            raise MediaBusy() from None
        loop = asyncio.get_running_loop()
        try:
            job = self._executor.submit(fn, *args, **kwargs)
        except BaseException:
            self.budget.release(cost, owner)
            raise

        def finished(_: Future[T]) -> None:
            # RuntimeError: the loop has closed, nobody is left to hand the budget to.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.budget.release, cost, owner)

        job.add_done_callback(finished)
        return await asyncio.wrap_future(job)

    async def aclose(self) -> None:
        """Drop queued work, wait for the decodes in progress (off the event loop)."""
        shutdown = functools.partial(self._executor.shutdown, wait=True, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, shutdown)
