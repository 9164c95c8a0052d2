"""The in-flight leases of gateway/store/limits.py against a real redis-server, in
process: a running request's lease is renewed past its expiry; a process that stops
renewing (it crashed) leaves leases that lapse, and the cap is free again. Marked
`redis` (scripts/test-store.sh)."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness.redis_server import RedisServer
from gateway.config.key_file import RateLimit
from gateway.store.client import StoreClient
from gateway.store.failures import SharedFailures
from gateway.store.limits import SharedLimits, Verdict
from tests.procs import free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]

DIGEST = hashlib.sha256(b"sk-leases-0123456789").digest()
# Short leases, renewed four times per lease: a loaded machine has a lease's three
# quarters to renew in time.
LEASE = 2.0
RENEW = 0.5


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    tmp: Path = tmp_path_factory.mktemp("leases")
    with RedisServer(free_port(), tmp / "redis.log") as server:
        yield server


def client(store: RedisServer) -> StoreClient:
    return StoreClient(store.url, prefix=f"test-{uuid.uuid4().hex[:8]}", timeout=2.0, retry=1.0)


def test_a_renewed_lease_holds_and_an_abandoned_one_lapses(store: RedisServer) -> None:
    async def run() -> list[Verdict]:
        shared = client(store)
        # Two processes of one prefix: `held` renews its lease, `crashed` never does.
        held = SharedLimits(shared, lease=LEASE, renew=RENEW)
        crashed = SharedLimits(shared, lease=LEASE, renew=3600)
        verdicts = []
        try:
            first = await held.admit(DIGEST, None, 2)
            second = await crashed.admit(DIGEST, None, 2)
            third = await held.admit(DIGEST, None, 2)
            assert first is not None and second is not None and third is not None
            verdicts += [first[0], second[0], third[0]]
            renewing = asyncio.create_task(held.run())
            try:
                # Past two lease lengths: the renewed lease holds, the other lapsed.
                await asyncio.sleep(2.5 * LEASE)
                fourth = await held.admit(DIGEST, None, 2)
                fifth = await held.admit(DIGEST, None, 2)
                assert fourth is not None and fifth is not None
                verdicts += [fourth[0], fifth[0]]
                # Given back: the cap is free again at once.
                assert first[2] is not None and fourth[2] is not None
                held.release(first[2])
                held.release(fourth[2])
                await asyncio.sleep(0.2)
                sixth = await held.admit(DIGEST, None, 2)
                assert sixth is not None
                verdicts.append(sixth[0])
            finally:
                renewing.cancel()
        finally:
            await shared.aclose()
        return verdicts

    admitted, refused = Verdict.admitted, Verdict.in_flight
    assert asyncio.run(run()) == [admitted, admitted, refused, admitted, refused, admitted]


def test_a_rate_and_a_cap_together_take_nothing_when_refused(store: RedisServer) -> None:
    """One script checks both: over the cap, no token is taken; over the rate, no lease."""

    async def run() -> list[Verdict]:
        shared = client(store)
        limits = SharedLimits(shared, lease=LEASE, renew=RENEW)
        rate = RateLimit(requests_per_second=0.001, burst=2)
        got = []
        try:
            for _ in range(3):  # two tokens and two leases, then over the cap
                answer = await limits.admit(DIGEST, rate, 2)
                assert answer is not None
                got.append(answer[0])
            limits.release(next(iter(limits.held)))
            await asyncio.sleep(0.2)
            answer = await limits.admit(DIGEST, rate, 2)  # a lease free, no token left
            assert answer is not None
            got.append(answer[0])
            assert answer[1] > 100  # seconds until the next token, at 0.001 per second
            assert len(limits.held) == 1
        finally:
            await shared.aclose()
        return got

    a, r, f = Verdict.admitted, Verdict.rate, Verdict.in_flight
    assert asyncio.run(run()) == [a, a, f, r]


def test_failures_count_per_address_in_a_window_all_replicas_share(store: RedisServer) -> None:
    """Two processes count into one window per address; another address, or the next
    window, starts from one."""

    async def run() -> list[int | None]:
        shared = client(store)
        now = [999_960.0]  # a window starts: 16666 x 60
        one, two = SharedFailures(shared, lambda: now[0]), SharedFailures(shared, lambda: now[0])
        try:
            got = [await one.add("192.0.2.1", 60), await two.add("192.0.2.1", 60)]
            got.append(await one.add("2001:db8::1", 60))
            now[0] += 59.9  # still the window [999960, 1000020)
            got.append(await two.add("192.0.2.1", 60))
            now[0] += 0.2  # the next one
            got.append(await one.add("192.0.2.1", 60))
        finally:
            await shared.aclose()
        return got

    assert asyncio.run(run()) == [1, 2, 1, 3, 1]


def test_failures_without_a_store_are_none() -> None:
    async def run() -> int | None:
        shared = StoreClient(f"redis://127.0.0.1:{free_port()}/0", prefix="t", timeout=0.5, retry=5)
        try:
            return await SharedFailures(shared).add("192.0.2.1", 60)
        finally:
            await shared.aclose()

    assert asyncio.run(run()) is None


def test_a_lease_of_several_sequences_holds_them_all(store: RedisServer) -> None:
    """A weight of N takes N tokens and a lease of N members under the cap, renewed
    together and given back together; over the cap or the rate it takes nothing."""

    async def run() -> None:
        shared = client(store)
        limits = SharedLimits(shared, lease=LEASE, renew=RENEW)
        leases = f"{shared.prefix}:k:{DIGEST.hex()}:leases"
        bucket = f"{shared.prefix}:k:{DIGEST.hex()}:rate"
        rate = RateLimit(requests_per_second=0.001, burst=10)
        try:
            six = await limits.admit(DIGEST, rate, 8, 6)
            assert six is not None and six[0] is Verdict.admitted and six[2] is not None
            assert await shared.redis.zcard(leases) == 6
            over = await limits.admit(DIGEST, rate, 8, 3)  # 6 + 3 > 8
            assert over is not None and over[0] is Verdict.in_flight
            assert float(await shared.redis.hget(bucket, "tokens")) == pytest.approx(4, abs=0.01)
            poor = await limits.admit(DIGEST, rate, 8, 2)  # 6 + 2 fits; 2 of 4 tokens
            assert poor is not None and poor[0] is Verdict.admitted and poor[2] is not None
            broke = await limits.admit(DIGEST, rate, None, 3)  # 2 tokens left
            assert broke is not None and broke[0] is Verdict.rate and broke[1] > 100
            assert await shared.redis.zcard(leases) == 8
            # Renewed past two lease lengths, every member of both leases holds.
            renewing = asyncio.create_task(limits.run())
            try:
                await asyncio.sleep(2.5 * LEASE)
                await shared.redis.zremrangebyscore(leases, "-inf", int(time.time() * 1000))
                assert await shared.redis.zcard(leases) == 8
            finally:
                renewing.cancel()
            limits.release(six[2])
            await asyncio.sleep(0.2)
            assert await shared.redis.zcard(leases) == 2
            limits.release(poor[2])
            await asyncio.sleep(0.2)
            assert await shared.redis.zcard(leases) == 0
            assert limits.held == {} and limits.weights == {}
        finally:
            await shared.aclose()

    asyncio.run(run())
