"""What every client connection of a process is held to, and the one sweep that keeps
the deadlines: the head's, the keep-alive wait's, an unread answer's (gateway/server/protocol.py)
and the request body's (gateway/proxy/body.py).

The app builds one `ConnectionGuard` from settings and hands it to the connection
protocol through the lifespan state (the dict uvicorn gives every connection it opens)
and to the body reader through the proxy; each worker process builds its own.

A deadline is a float, moved a few times a request (the head complete, each body chunk,
the response sent), never a timer: one timer per process sweeps the open connections and
the bodies being read a few times a second, so a deadline is kept to within `interval`
(0.5 s at most). An asyncio timer armed and cancelled per request costs ~8 us of CPU on
this machine, a twentieth of the gateway's whole added latency; uvicorn's own keep-alive
timer, which the protocol replaces, is one more.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from gateway.config.settings import LimitsSettings, TimeoutSettings
from gateway.observability.metrics import ConnectionCounts
from gateway.server.process import fd_limit as process_fd_limit

# The lifespan state key under which the app hands the guard to the protocol.
CONNECTION_GUARD = "gateway.connection_guard"
# Descriptors kept free besides client connections and one engine connection per request
# in flight: the listening socket, media fetches, log and key files, DNS, health checks.
FD_RESERVE = 256
# Longest time between sweeps; shorter when the head deadline is short.
SWEEP_INTERVAL = 0.5
# After a 431 the connection stays open this long at most, its input read and dropped,
# so the answer is not lost to a reset while the client is still sending its head.
LINGER = 2.0

log = structlog.get_logger("gateway.server.limits")


class Timed(Protocol):
    """A connection as the sweep sees it: a deadline (loop time; inf for none) and what
    to do when it has passed."""

    @property
    def deadline(self) -> float: ...

    def expire(self) -> None: ...

    def evict(self) -> None:
        """Close the connection to make room for a new one (it is waiting for a head)."""


def fit_connections(max_connections: int, max_in_flight: int, fd_limit: int) -> int:
    """`max_connections`, lowered if need be so that as many client connections, one
    engine connection per request in flight and `FD_RESERVE` fit in `fd_limit`: at the
    file-descriptor limit accepting fails, for every client alike."""
    room = fd_limit - max_in_flight - FD_RESERVE
    if max_connections <= room:
        return max_connections
    fitted = max(room, fd_limit // 2)
    log.warning(
        "fd_limit_low",
        fd_limit=fd_limit,
        needed=max_connections + max_in_flight + FD_RESERVE,
        max_connections=fitted,
        hint="raise the open-files limit (ulimit -n, the container's nofile) or lower "
        "limits.max_connections / limits.max_in_flight",
    )
    return fitted


@dataclass(frozen=True, slots=True)
class BodyPace:
    """How fast a body must arrive, counted from the first read: whole within `deadline`
    seconds, and from `grace` seconds on at `rate` bytes a second on average (counted
    from the end of the grace; 0: no minimum). The rule: at `t` seconds at least
    rate * (t - grace) bytes have arrived, and all of them by `deadline`."""

    deadline: float
    grace: float
    rate: float

    def due(self, received: int) -> float:
        """Seconds from the start by which more than `received` bytes must have arrived
        (or the body ended): when the rate's requirement overtakes `received`."""
        if self.rate <= 0:
            return self.deadline
        return min(self.deadline, self.grace + received / self.rate)


class ConnectionGuard:
    """The connection limits of one process, the open connections and the sweep."""

    def __init__(
        self,
        timeouts: TimeoutSettings,
        limits: LimitsSettings,
        counts: ConnectionCounts | None = None,
        fd_limit: int | None = None,
    ) -> None:
        if fd_limit is None:
            fd_limit = process_fd_limit()
        self.request_head = timeouts.request_head
        self.keepalive = timeouts.client_keepalive
        self.response_stall = timeouts.response_stall
        self.max_header_bytes = limits.max_header_bytes
        self.max_connections = fit_connections(
            limits.max_connections, limits.max_in_flight, fd_limit
        )
        self.linger = min(LINGER, timeouts.request_head)
        self.body_pace = BodyPace(
            timeouts.request_body, timeouts.request_body_grace, limits.min_body_rate
        )
        shortest = min(
            timeouts.request_head,
            timeouts.client_keepalive,
            timeouts.response_stall,
            timeouts.request_body_grace,
        )
        self.interval = min(SWEEP_INTERVAL, shortest / 4)
        self.counts = counts or ConnectionCounts()
        self.open: set[Timed] = set()
        # The open connections waiting for a head (none arrived yet, or it is incomplete),
        # longest waiting first: at the cap the first makes room for a new connection.
        # A connection leaves when its head completes and comes back, last, when its
        # response is sent; one with a request in progress is never here.
        self.waiting: OrderedDict[Timed, None] = OrderedDict()
        # Tasks reading a request body, and the loop time by which their next chunk is
        # due by `body_pace` (proxy/body.py read_body); those the sweep cancelled for
        # being late.
        self.bodies: dict[asyncio.Task[Any], float] = {}
        self.late: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def add(self, conn: Timed, loop: asyncio.AbstractEventLoop) -> None:
        """Watch `conn` until `discard`."""
        self.open.add(conn)
        if self._timer is None:
            self.start(loop)

    def discard(self, conn: Timed) -> None:
        self.open.discard(conn)
        self.waiting.pop(conn, None)

    def make_room(self) -> bool:
        """At the cap: close the connection that has waited longest for a head, so a
        client that sends its head at once displaces one that does not. False when every
        connection has a request in progress (the new one is refused then)."""
        if not self.waiting:
            return False
        conn, _ = self.waiting.popitem(last=False)
        self.counts.evicted += 1
        conn.evict()
        return True

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the sweep on `loop`: the lifespan does, with the loop it binds (or, in
        an app run without one, the first connection or body)."""
        if self._timer is None:
            self._loop = loop
            self._timer = loop.call_later(self.interval, self._sweep)

    def running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the sweep runs on (the lifespan's), started on the running loop if
        it is not running. Kept rather than looked up per request: asyncio's lookup costs
        a getpid() system call on Python 3.11 (two per request in read_body, strace)."""
        if self._timer is None:
            self.start(asyncio.get_running_loop())
        assert self._loop is not None
        return self._loop

    def _sweep(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        # Collected first: expiring closes transports, and their connection_lost (which
        # discards them) may come within the loop.
        for conn in [c for c in self.open if c.deadline <= now]:
            conn.expire()
        if self.bodies:
            for task in [t for t, due in self.bodies.items() if due <= now]:
                # read_body turns this cancellation into a 408.
                del self.bodies[task]
                self.late.add(task)
                task.cancel()
        self._timer = self._loop.call_later(self.interval, self._sweep)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
