"""Admission: whether a request may go on now, in two stages.

    admission.enter_key(key)               # at authentication (middleware.KeyLimits)
    try:
        incoming = await read_incoming(...)
        with admission.slot():             # once the body is in (proxy/handler.py)
            ...inspect, forward, relay...
    finally:
        admission.leave_key(key)

Per key, from authentication on: a cap on the key's requests in flight, its body still
arriving included, so one key's slow uploads hold a bounded number of connections; and
an optional token bucket. Over either: 429 `rate_limited` with Retry-After.

Globally, once the body is in: `limits.max_in_flight`; over it, 503 `overloaded`. A
request whose body is still trickling in holds no global slot, so one key's slow
uploads cannot take every slot and lock the other tenants out (docs/facts.md,
"Admission").

A count is given back however the request ends; a refusal takes nothing. No object is
allocated per request: the two stages cost 1.1 us per request over one global counter
(1.7 us with a rate limit), a context manager made per stage 2.5 us (docs/facts.md,
"Admission").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import TracebackType

from gateway.config.key_file import ApiKey, RateLimit
from gateway.config.settings import LimitsSettings
from gateway.errors import Overloaded, RateLimited
from gateway.observability.metrics import Metrics


class TokenBucket:
    """`limit.capacity` tokens, refilled at `limit.requests_per_second`; starts full."""

    __slots__ = ("capacity", "limit", "rate", "stamp", "tokens")

    def __init__(self, limit: RateLimit, now: float) -> None:
        self.limit = limit
        # Plain floats: reading them off the settings model costs a microsecond per take.
        self.rate = limit.requests_per_second
        self.capacity = float(limit.capacity)
        self.tokens = self.capacity
        self.stamp = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 if one was there, else the seconds until one will be
        (nothing is taken then)."""
        tokens = self.tokens + (now - self.stamp) * self.rate
        if tokens > self.capacity:
            tokens = self.capacity
        self.stamp = now
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return 0.0
        self.tokens = tokens
        return (1.0 - tokens) / self.rate


def retry_after(wait: float) -> int:
    """Whole seconds for Retry-After: rounded up, at least 1."""
    return max(1, math.ceil(wait))


class Admission:
    """The global slot, the per-key slots and the per-key buckets of one app.

    Per-key state is held by the key's digest, so a key keeps its count and its bucket
    across key-file reloads. The anonymous key (allow_unauthenticated) is one key: every
    unauthenticated request shares its cap and its bucket.
    """

    def __init__(
        self,
        limits: LimitsSettings,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limits.max_in_flight
        self.per_key = limits.max_in_flight_per_key
        self.rate = limits.rate_per_key
        self.current = 0
        # Requests in flight per key digest; a key with none has no entry.
        self.keys: dict[bytes, int] = {}
        self._buckets: dict[bytes, TokenBucket] = {}
        self._clock = clock
        self._refused = metrics.rate_limited
        self._slot = GlobalSlot(self)
        metrics.count_in_flight(lambda: self.current)

    def slot(self) -> GlobalSlot:
        """The context manager that holds one of `max_in_flight` slots while its block
        runs (Overloaded when none is free); one object, entered by every request."""
        return self._slot

    def enter_key(self, key: ApiKey) -> None:
        """Count a request of `key`, after taking a token from its bucket; RateLimited
        when either is out, with nothing taken. The caller must `leave_key` after."""
        held = self.keys.get(key.digest, 0)
        cap = key.max_in_flight if key.max_in_flight is not None else self.per_key
        if held >= cap:
            self._refused.labels("in_flight").inc()
            raise RateLimited(
                f"This API key has {cap} requests in flight, its limit; retry when one completes.",
                retry_after=1,
            )
        rate = key.rate if key.rate is not None else self.rate
        if rate is not None:
            wait = self._bucket(key.digest, rate).take(self._clock())
            if wait > 0.0:
                self._refused.labels("rate").inc()
                seconds = retry_after(wait)
                raise RateLimited(
                    f"This API key is over its rate limit of {rate.requests_per_second:g} "
                    f"requests per second; retry in {seconds} s.",
                    retry_after=seconds,
                )
        self.keys[key.digest] = held + 1

    def leave_key(self, key: ApiKey) -> None:
        held = self.keys[key.digest] - 1
        if held:
            self.keys[key.digest] = held
        else:
            del self.keys[key.digest]

    def _bucket(self, digest: bytes, rate: RateLimit) -> TokenBucket:
        bucket = self._buckets.get(digest)
        if bucket is None or (bucket.limit is not rate and bucket.limit != rate):
            # New, or its limit changed with a key-file reload: a full bucket.
            bucket = self._buckets[digest] = TokenBucket(rate, self._clock())
        return bucket


class GlobalSlot:
    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def __enter__(self) -> None:
        admission = self._admission
        if admission.current >= admission.limit:
            raise Overloaded(retry_after=1)
        admission.current += 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._admission.current -= 1
