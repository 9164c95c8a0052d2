"""Admission: whether a request may go on now, in two stages.

    admission.enter_key(key)               # at authentication (middleware.Front)
    try:
        incoming = await read_incoming(...)
        charge = await admission.charge(key, weight)   # the body's sequences (handler)
        try:
            with admission.slot():         # once the body is in (proxy/handler.py)
                ...inspect, forward, relay...
        finally:
            if charge is not None:
                admission.refund(charge)
    finally:
        admission.leave_key(key)

Per key, from authentication on: a cap on the key's engine sequences in flight, its
body still arriving included, so one key's slow uploads hold a bounded number of
connections; and an optional token bucket, a token per sequence. A request counts as
one sequence until its body is read, then as the sequences the body makes the engine
run (prompts x `n`, batch conversations, inputs: gateway/payload/sequences.py). Over
either: 429 `rate_limited` with Retry-After; a request heavier than the key's cap or
burst, or than `limits.max_sequences_per_request`, 400 `too_many_sequences`.

Globally, once the body is in: `limits.max_in_flight`; over it, 503 `overloaded`. A
request whose body is still trickling in holds no global slot, so one key's slow
uploads cannot take every slot and lock the other tenants out (docs/facts.md,
"Admission").

A count is given back however the request ends; a refusal takes nothing (a refusal
of the body's sequences leaves the first, taken at authentication, taken). No object
is allocated per request of one sequence: the two stages cost 1.1 us per request over
one global counter (1.7 us with a rate limit), a context manager made per stage
2.5 us (docs/facts.md, "Admission").

With a store (`store_url`), a key that has a rate (its own or `limits.rate_per_key`)
or its own `max_in_flight` is admitted through it instead (`enter_shared`,
gateway/store/limits.py): those limits then hold for the key across every worker and
replica. The default `max_in_flight_per_key` and the global `max_in_flight` stay per
process, and a key without limits of its own never waits on the store. While the store
is down, each shared limit does what its `limits.*_when_store_down` says: `local`, the
per-process limit above; `refuse`, 503 `limits_unavailable`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import TracebackType

from gateway.config.key_file import ApiKey, RateLimit
from gateway.config.settings import LimitsSettings
from gateway.errors import LimitsUnavailable, Overloaded, RateLimited, TooManySequences
from gateway.observability.metrics import Metrics
from gateway.store.limits import SharedLimits, Verdict


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

    def take(self, now: float, count: float = 1.0) -> float:
        """Take `count` tokens: 0.0 if they were there, else the seconds until they will
        be (nothing is taken then)."""
        tokens = self.tokens + (now - self.stamp) * self.rate
        if tokens > self.capacity:
            tokens = self.capacity
        self.stamp = now
        if tokens >= count:
            self.tokens = tokens - count
            return 0.0
        self.tokens = tokens
        return (count - tokens) / self.rate


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
        shared: SharedLimits | None = None,
    ) -> None:
        self.limit = limits.max_in_flight
        self.per_key = limits.max_in_flight_per_key
        self.rate = limits.rate_per_key
        self.max_sequences = limits.max_sequences_per_request
        self.current = 0
        # Requests in flight per key digest; a key with none has no entry.
        self.keys: dict[bytes, int] = {}
        self._buckets: dict[bytes, TokenBucket] = {}
        self._clock = clock
        self._refused = metrics.rate_limited
        self._slot = GlobalSlot(self)
        metrics.count_in_flight(lambda: self.current)
        # The store's limits (None: no store), what each does while it is down, and the
        # admissions decided without it: (limit, action) -> count.
        self.shared = shared
        self._when_down = {
            "in_flight": limits.in_flight_when_store_down,
            "rate": limits.rate_when_store_down,
        }
        self.store_fallbacks: dict[tuple[str, str], int] = {}

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
            raise self._over_cap(cap)
        rate = key.rate if key.rate is not None else self.rate
        if rate is not None:
            wait = self._bucket(key.digest, rate).take(self._clock())
            if wait > 0.0:
                raise self._over_rate(rate, wait)
        self.keys[key.digest] = held + 1

    def shares(self, key: ApiKey) -> bool:
        """Whether `key` is admitted through the store: there is one, and the key has
        a rate or its own in-flight cap."""
        return self.shared is not None and (
            key.rate is not None or self.rate is not None or key.max_in_flight is not None
        )

    async def enter_shared(self, key: ApiKey, count: int = 1) -> str | None:
        """`enter_key` for a key that `shares`: its rate and its own in-flight cap
        checked in the store (the default cap per process, first), for `count`
        sequences. Returns the lease's token, for `leave_shared`, which the caller must
        call after."""
        assert self.shared is not None
        digest = key.digest
        cap = key.max_in_flight
        rate = key.rate if key.rate is not None else self.rate
        held = self.keys.get(digest, 0)
        if cap is None and held + count > self.per_key:
            raise self._over_cap(self.per_key)
        # Counted before the round trip: the requests of this process that wait on the
        # store at once all see it.
        self.keys[digest] = held + count
        try:
            answer = await self.shared.admit(digest, rate, cap, count)
            if answer is None:
                self._without_store(key, cap, rate, count)
                return None
        except BaseException:
            self.leave_key(key, count)
            raise
        verdict, wait, token = answer
        if verdict is Verdict.admitted:
            return token
        self.leave_key(key, count)
        if verdict is Verdict.in_flight:
            assert cap is not None
            raise self._over_cap(cap)
        assert rate is not None
        raise self._over_rate(rate, wait)

    async def charge(self, key: ApiKey, weight: int, param: str | None = None) -> Charge | None:
        """Charge a request of `key`, admitted at authentication as one sequence
        (`enter_key` or `enter_shared`), for the rest of the `weight` engine sequences
        its body asks for (gateway/payload/sequences.py), against the same in-flight
        cap and rate. None for a weight of 1; otherwise the caller must `refund` the
        charge when the request ends.

        TooManySequences (400) for a request that can never be admitted: heavier than
        `max_sequences_per_request`, the key's cap or its burst. RateLimited or
        LimitsUnavailable as at authentication; the sequence taken then stays taken
        (the body was read), nothing more is."""
        if weight <= 1:
            return None
        if weight > self.max_sequences:
            raise TooManySequences(
                f"This request makes the engine run {weight} sequences; the gateway "
                f"accepts at most {self.max_sequences} in one request.",
                param=param,
            )
        cap = key.max_in_flight if key.max_in_flight is not None else self.per_key
        rate = key.rate if key.rate is not None else self.rate
        if weight > cap or (rate is not None and weight > rate.capacity):
            limit = cap if weight > cap else rate.capacity  # type: ignore[union-attr]
            raise TooManySequences(
                f"This request makes the engine run {weight} sequences; this API key "
                f"may run at most {limit} at once.",
                param=param,
            )
        extra = weight - 1
        if self.shares(key):
            return Charge(key, extra, await self.enter_shared(key, extra))
        digest = key.digest
        held = self.keys[digest]
        if held + extra > cap:
            raise self._over_cap(cap)
        if rate is not None:
            wait = self._bucket(digest, rate).take(self._clock(), extra)
            if wait > 0.0:
                raise self._over_rate(rate, wait)
        self.keys[digest] = held + extra
        return Charge(key, extra, None)

    def refund(self, charge: Charge) -> None:
        """Give back what `charge` took."""
        self.leave_shared(charge.key, charge.token, charge.extra)

    def _without_store(
        self, key: ApiKey, cap: int | None, rate: RateLimit | None, count: int = 1
    ) -> None:
        """The store did not answer: each shared limit refuses or is checked in this
        process, as its setting says; the `count` sequences are already in `keys`."""
        assert self.shared is not None
        for limit, shared in (("in_flight", cap is not None), ("rate", rate is not None)):
            if shared:
                action = self._when_down[limit]
                counted = (limit, action)
                self.store_fallbacks[counted] = self.store_fallbacks.get(counted, 0) + 1
                if action == "refuse":
                    raise LimitsUnavailable(retry_after=retry_after(self.shared.client.retry))
        digest = key.digest
        held = self.keys[digest] - count
        if cap is not None and held + count > cap:
            raise self._over_cap(cap)
        if rate is not None:
            wait = self._bucket(digest, rate).take(self._clock(), count)
            if wait > 0.0:
                raise self._over_rate(rate, wait)

    def _over_cap(self, cap: int) -> RateLimited:
        self._refused.labels("in_flight").inc()
        return RateLimited(
            f"This API key has {cap} engine sequences in flight, its limit; retry when "
            "one completes.",
            retry_after=1,
        )

    def _over_rate(self, rate: RateLimit, wait: float) -> RateLimited:
        self._refused.labels("rate").inc()
        seconds = retry_after(wait)
        return RateLimited(
            f"This API key is over its rate limit of {rate.requests_per_second:g} "
            f"engine sequences per second; retry in {seconds} s.",
            retry_after=seconds,
        )

    def leave_shared(self, key: ApiKey, token: str | None, count: int = 1) -> None:
        self.leave_key(key, count)
        if token is not None:
            assert self.shared is not None
            self.shared.release(token)

    def leave_key(self, key: ApiKey, count: int = 1) -> None:
        held = self.keys[key.digest] - count
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


class Charge:
    """The sequences of a request beyond its first (`Admission.charge`)."""

    __slots__ = ("extra", "key", "token")

    def __init__(self, key: ApiKey, extra: int, token: str | None) -> None:
        self.key = key
        self.extra = extra
        # The store's lease for them, if one was taken.
        self.token = token


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
