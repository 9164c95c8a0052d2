"""A key's rate limit and in-flight cap held in the store, for all workers and replicas.

One round trip per admission: a Lua script, atomic on the Redis server, so no two
processes can both take a key's last token or its last slot (nothing is read into
Python and written back). Keys (`<prefix>` is `store_prefix`; the digest is the key's
SHA-256, never the key):

    <prefix>:k:<digest hex>:rate     hash: the bucket's tokens and its stamp (ms of the
                                     store's clock); gone once it would be full again
    <prefix>:k:<digest hex>:leases   sorted set: one member per engine sequence of an
                                     admitted request (its random token, then
                                     `<token>.1`, `<token>.2`, ...), scored by its
                                     expiry (ms)

The in-flight cap is a count of leases, not a counter: a process that dies holding
requests leaves leases that lapse `LEASE` seconds later, where a counter would stay
raised for ever. A running request's lease is renewed every `RENEW` seconds (one
script for all of a process's leases); a finished one's is removed, the removals of a
loop tick sent together. A removal or renewal that fails is not retried: the lease
lapses.
"""

from __future__ import annotations

import asyncio
import math
import os
from enum import IntEnum

from gateway.config.key_file import RateLimit
from gateway.store.client import StoreClient

# Seconds a lease holds without renewal, and how often running requests renew theirs.
LEASE = 30.0
RENEW = 10.0

# KEYS: the bucket's hash, the leases' set. ARGV: the rate (requests per second, 0:
# none), the burst, the cap (0: none), the lease (ms), the request's token, the
# bucket's TTL (ms), the weight (engine sequences: tokens taken, members added).
# Returns {verdict, wait in ms}: 0 admitted (the tokens taken, the lease added), 1 over
# the rate (nothing taken), 2 over the cap (nothing taken).
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local cap = tonumber(ARGV[3])
local weight = tonumber(ARGV[7])
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) + weight > cap then return {2, 0} end
end
local rate = tonumber(ARGV[1])
if rate > 0 then
  local burst = tonumber(ARGV[2])
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
  local tokens = burst
  if b[1] then
    tokens = math.min(burst, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate / 1000)
  end
  if tokens < weight then return {1, math.ceil((weight - tokens) * 1000 / rate)} end
  redis.call('HSET', KEYS[1], 'tokens', tokens - weight, 'stamp', now)
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
end
if cap > 0 then
  local expiry = now + tonumber(ARGV[4])
  redis.call('ZADD', KEYS[2], expiry, ARGV[5])
  for i = 1, weight - 1 do
    redis.call('ZADD', KEYS[2], expiry, ARGV[5] .. '.' .. i)
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return {0, 0}
"""

# KEYS: leases' sets; ARGV: the lease (ms), then each set's token and weight. Moves the
# expiry of each lease's members to a lease from now, if they are still there.
RENEW_LEASES = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local expiry = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 + lease
for i, key in ipairs(KEYS) do
  local token = ARGV[2 * i]
  redis.call('ZADD', key, 'XX', expiry, token)
  for j = 1, tonumber(ARGV[2 * i + 1]) - 1 do
    redis.call('ZADD', key, 'XX', expiry, token .. '.' .. j)
  end
  redis.call('PEXPIRE', key, lease)
end
return #KEYS
"""


class Verdict(IntEnum):
    admitted = 0
    rate = 1
    in_flight = 2


class SharedLimits:
    """Per-key limits in the store. `admit` never raises for the store's sake: None
    means the store is not usable now, the caller decides without it."""

    def __init__(self, client: StoreClient, *, lease: float = LEASE, renew: float = RENEW) -> None:
        self.client = client
        self._every = renew
        self._prefix = f"{client.prefix}:k:"
        self._admit = client.script(ADMIT)
        self._renew = client.script(RENEW_LEASES)
        self._lease_ms = str(int(lease * 1000))
        # Lease tokens: this process's random part and a count. Built in the process
        # that serves (each worker builds its own app), so no two processes share one.
        self._nonce = os.urandom(8).hex()
        self._count = 0
        # Token -> its leases' set, for every request of this process holding a lease;
        # the weight of those whose lease has more than one member.
        self.held: dict[str, str] = {}
        self.weights: dict[str, int] = {}
        # Leases to remove (set, token, weight), sent together once per loop tick.
        self._released: list[tuple[str, str, int]] = []
        self._flush: asyncio.Task[None] | None = None

    async def admit(
        self, digest: bytes, rate: RateLimit | None, cap: int | None, weight: int = 1
    ) -> tuple[Verdict, float, str | None] | None:
        """Take `weight` tokens of `rate` and a lease of `weight` members under `cap`
        for the key of `digest`, or neither: (verdict, seconds until the tokens are
        there, the lease's token if one was taken). None: the store is not usable,
        nothing was taken."""
        if not self.client.usable():
            return None
        base = self._prefix + digest.hex()
        leases = base + ":leases"
        token = None
        if cap is not None:
            self._count += 1
            token = f"{self._nonce}{self._count:x}"
        if rate is not None:
            per_second = rate.requests_per_second
            # Until the bucket would be full again, when its absence reads the same.
            ttl = str(math.ceil(rate.capacity / per_second * 1000) + 1000)
            args = [repr(per_second), str(rate.capacity)]
        else:
            ttl, args = "0", ["0", "0"]
        args += [str(cap or 0), self._lease_ms, token or "", ttl, str(weight)]
        keys = [base + ":rate", leases]

        async def call() -> tuple[int, int]:
            verdict, wait_ms = await self._admit(keys=keys, args=args)
            return int(verdict), int(wait_ms)

        answer = await self.client.attempt(call)
        if answer is None:
            return None
        verdict = Verdict(answer[0])
        if verdict is not Verdict.admitted:
            return verdict, answer[1] / 1000, None
        if token is not None:
            self.held[token] = leases
            if weight > 1:
                self.weights[token] = weight
        return verdict, 0.0, token

    def release(self, token: str) -> None:
        """Give the lease back (sent with the other releases of this loop tick)."""
        leases = self.held.pop(token)
        weight = self.weights.pop(token, 1) if self.weights else 1
        self._released.append((leases, token, weight))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_task(self._send_releases())

    async def _send_releases(self) -> None:
        batch, self._released = self._released, []
        self._flush = None
        if not self.client.usable():
            return  # they lapse
        if len(batch) == 1:
            # One command: a pipeline object costs more CPU than the command itself.
            ((leases, token, weight),) = batch
            members = _members(token, weight)
            await self.client.attempt(lambda: self.client.redis.zrem(leases, *members))
            return
        pipe = self.client.redis.pipeline(transaction=False)
        for leases, token, weight in batch:
            pipe.zrem(leases, *_members(token, weight))
        await self.client.attempt(pipe.execute)

    async def renew(self) -> None:
        """Move the expiry of every lease this process holds to a lease from now."""
        if not self.held or not self.client.usable():
            return
        held = list(self.held.items())
        keys = [leases for _, leases in held]
        weights = self.weights
        args = [self._lease_ms]
        for token, _ in held:
            args += (token, str(weights.get(token, 1)))
        await self.client.attempt(lambda: self._renew(keys=keys, args=args))

    async def run(self) -> None:
        """Renew the held leases every `renew` seconds, for ever (the lifespan's task)."""
        while True:
            await asyncio.sleep(self._every)
            await self.renew()


def _members(token: str, weight: int) -> list[str]:
    """The members of a lease of `weight` (ADMIT adds them)."""
    return [token, *(f"{token}.{i}" for i in range(1, weight))]
