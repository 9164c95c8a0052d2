"""Sending a request to an engine: failover along the policy's order, each engine held
by a `Lease`, and the one mapping from upstream failures to gateway errors.

A request moves to the next engine only when the previous one provably received
nothing (the connection was refused). Once a request was written it may have started,
so it is never sent again elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from gateway.errors import GatewayError, UpstreamBroken, UpstreamTimeout, UpstreamUnavailable
from gateway.exchange import Exchange
from gateway.metrics import Metrics
from gateway.routing.pool import Engine, EnginePool, Lease
from gateway.upstream import (
    ConnectFailed,
    FirstByteTimeout,
    Origin,
    ReadTimeout,
    Response,
    UpstreamClient,
    UpstreamError,
)

Relay = Callable[[Response], Awaitable[None]]


def gateway_error(exc: UpstreamError | TimeoutError, *, answering: bool) -> GatewayError:
    """The client-facing error for an upstream failure: before the engine started
    answering (`answering` False) or while its answer was being read."""
    if isinstance(exc, FirstByteTimeout):
        return UpstreamTimeout("The engine did not start answering in time.")
    if isinstance(exc, ReadTimeout | TimeoutError):
        # The engine went quiet mid-answer, small or streamed: the same error either way.
        return UpstreamTimeout()
    if answering:
        return UpstreamBroken()
    return UpstreamUnavailable("The connection to the engine failed.")


class Forwarder:
    """Sends requests through an upstream client (`UpstreamClient`: the real one, or a
    fake engine in tests) and hands each answer to a relay while its engine is leased."""

    def __init__(self, upstream: UpstreamClient, pool: EnginePool, metrics: Metrics) -> None:
        self.upstream = upstream
        self.pool = pool
        self.metrics = metrics
        self._counts = metrics.routing
        self._origins: dict[str, Origin] = {}

    def origin(self, engine: Engine) -> Origin:
        origin = self._origins.get(engine.url)
        if origin is None:
            if len(self._origins) > 2 * len(self.pool.engines) + 16:
                # Engines named by DNS come and go: forget the origins of departed ones.
                self._origins.clear()
            try:
                origin = self._origins[engine.url] = Origin(engine.url)
            except ValueError:
                # Not a usable engine URL: nothing can reach it, like a refused connect.
                raise ConnectFailed("engine URL") from None
        return origin

    async def forward(
        self,
        ex: Exchange,
        order: Sequence[Engine],
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        data: bytes | None,
        relay: Relay,
    ) -> None:
        """Send to the first engine of `order` that accepts the connection and relay its
        answer. Raises the mapped GatewayError when forwarding fails."""
        pool = self.pool
        for attempt, engine in enumerate(order):
            if attempt:
                # The previous engine refused the connection: it received nothing, so
                # the request moves on (once per engine: `order` lists each once).
                ex.failovers = attempt
                self._counts.failovers += 1
            with Lease(engine):
                sent_at = time.perf_counter()
                try:
                    resp = await self.upstream.request(
                        self.origin(engine), method, target, headers, data
                    )
                except ConnectFailed:
                    # Nothing reached this engine: eject it and try the next one.
                    pool.eject(engine)
                    continue
                except UpstreamError as exc:
                    ex.engine = engine.url
                    pool.failed(engine)
                    raise gateway_error(exc, answering=False) from None
                ex.engine = engine.url
                ex.ttfb = time.perf_counter() - sent_at
                self.metrics.observe_ttfb(ex.route.label, ex.ttfb)
                if resp.status >= 500:
                    pool.failed(engine)
                elif engine.failures or engine.backoff:
                    pool.succeeded(engine)
                try:
                    await relay(resp)
                finally:
                    # A response read to its end goes back to the pool; after a disconnect
                    # or a broken stream the connection is closed, never reused half read.
                    resp.close()
                return
        raise UpstreamUnavailable("No engine accepted the connection.")
