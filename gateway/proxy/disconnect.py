"""Noticing that a client left while its request is being forwarded."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.exchange import Exchange
from gateway.types import Receive

# How long a request is forwarded before a task starts watching for its client leaving.
# A task per request (created, stepped, cancelled) cost ~70 us of event-loop work at 64
# connections (py-spy); the timer that replaces it for quick answers costs ~1 us. A client
# that leaves is noticed at most this much later.
WATCH_AFTER = 0.05


class DisconnectWatch:
    """Cancels `target` when its client disconnects, so the upstream connection closes
    and vLLM aborts the request and frees its KV blocks.

    The watching task is started only once the request has been forwarded for
    `WATCH_AFTER` seconds: most answers are complete sooner and then cost one timer, not
    a task. The caller must `stop()` the watch before sending the answer's last message
    (after it uvicorn's `receive` reports a disconnect) and when it is done.

    With `hold`, a client that leaves before `release()` (before its answer starts) only
    marks the exchange disconnected: the engine's request goes on, bounded by the
    first-byte timeout, so that its answer can be read and metered (the engine does the
    work whether or not the client waits for it; docs/gateway.md, "Metering").
    """

    __slots__ = ("_ex", "_handle", "_loop", "_receive", "_target", "_task", "hold")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        receive: Receive,
        ex: Exchange,
        target: asyncio.Task[Any],
        hold: bool = False,
    ) -> None:
        self.hold = hold
        self._loop = loop
        self._receive = receive
        self._ex = ex
        self._target = target
        self._task: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = loop.call_later(WATCH_AFTER, self._start)

    def _start(self) -> None:
        self._handle = None
        self._task = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._ex.disconnected = True
                if not self.hold:
                    self._target.cancel()
                return

    def release(self) -> None:
        """The answer starts: a client that leaves from now on cancels `target`."""
        self.hold = False

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
