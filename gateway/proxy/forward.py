"""Sending a request to an engine: failover along the policy's order, each engine
counted in its `in_flight` while it serves the request, and the one mapping from upstream
failures to gateway errors.

A request moves to the next engine only when the previous one provably received
nothing (the connection was refused). Once a request was written it may have started,
so it is never sent again elsewhere, with one exception: an engine that closed a reused
connection without answering and then refused a fresh one (`ReconnectFailed`) is going
away; a GET or HEAD then moves on, a POST (which that engine may have read) does not.
The upstream client already sent the request once more to the same engine on a fresh
connection (gateway/upstream/client.py): a keep-alive connection closed under a request is
neither an error nor a health failure.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from gateway.errors import GatewayError, UpstreamBroken, UpstreamTimeout, UpstreamUnavailable
from gateway.exchange import Exchange
from gateway.observability.metrics import Metrics
from gateway.routing.engine import Engine
from gateway.routing.key_errors import KeyErrors
from gateway.routing.pool import EnginePool
from gateway.upstream.errors import (
    ConnectFailed,
    FirstByteTimeout,
    ReadTimeout,
    ReconnectFailed,
    UpstreamError,
)
from gateway.upstream.interfaces import Response, UpstreamClient

Relay = Callable[[Response], Awaitable[None]]
# Methods that may go to another engine after ReconnectFailed: they change nothing.
IDEMPOTENT = frozenset({"GET", "HEAD"})


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

    def __init__(
        self,
        upstream: UpstreamClient,
        pool: EnginePool,
        metrics: Metrics,
        key_errors: KeyErrors | None = None,
    ) -> None:
        self.upstream = upstream
        self.pool = pool
        self.metrics = metrics
        # Engine failures (5xx, timeouts) per key (routing/key_errors.py); None: not counted.
        self.key_errors = key_errors
        self._counts = metrics.routing

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
            # Counted in the engine's `in_flight` while it serves the request, however
            # the request ends (a `with` object cost three Python calls a request), and
            # in its `sent` for good.
            engine.in_flight += 1
            engine.sent += 1
            try:
                sent_at = time.perf_counter()
                try:
                    resp = await self.upstream.request(engine.origin, method, target, headers, data)
                except ConnectFailed as exc:
                    # Nothing reached this engine: eject it and try the next one.
                    pool.eject(engine, error=exc)
                    continue
                except ReconnectFailed as exc:
                    # The engine refuses connections now: eject it. A GET moves on; a
                    # POST it may have read before closing is not sent elsewhere.
                    pool.eject(engine, error=exc)
                    if method in IDEMPOTENT:
                        continue
                    ex.engine = engine.public_url
                    raise gateway_error(exc, answering=False) from None
                except UpstreamError as exc:
                    ex.engine = engine.public_url
                    # A timeout or a broken answer: maybe this request's doing (a long
                    # enough generation outlasts timeouts.first_byte), counted like a 5xx.
                    pool.failed(engine, ex.key_name or "")
                    if self.key_errors is not None:
                        await self.key_errors.failed(ex.key_name)
                    raise gateway_error(exc, answering=False) from None
                # The engine has the body (it answers): not held for the answer's length.
                data = None
                ex.engine = engine.public_url
                ex.ttfb = time.perf_counter() - sent_at
                self.metrics.observe_ttfb(ex.route.label, ex.ttfb)
                if resp.status >= 500:
                    # Maybe this request's doing: counted for its key, and toward
                    # ejection only with other keys' (routing/pool.py, `failed`).
                    pool.failed(engine, ex.key_name or "", resp.status)
                    if self.key_errors is not None:
                        await self.key_errors.failed(ex.key_name)
                else:
                    engine.answered_at = time.monotonic()
                    if engine.failures or engine.backoff:
                        pool.succeeded(engine)
                try:
                    await relay(resp)
                finally:
                    # A response read to its end goes back to the pool; after a disconnect
                    # or a broken stream the connection is closed, never reused half read.
                    resp.close()
                return
            finally:
                engine.in_flight -= 1
        raise UpstreamUnavailable("No engine accepted the connection.")
