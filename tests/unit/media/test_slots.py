"""gateway/media/slots.py in-process: the order in which `FairSlots` hands freed slots
to waiting owners, as tables, and its bookkeeping under cancellation. Through the
running gateway with a slow origin: test_gateway_media_fairness.py."""

from __future__ import annotations

import asyncio

import pytest

from gateway.media.slots import FairSlots


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def grant_order(limit: int, holders: list[str], arrivals: list[str]) -> list[str]:
    """`holders` take the `limit` slots, then `arrivals` queue in this order. Slots are
    released one at a time, the longest held first: the owners in the order served."""
    slots = FairSlots(limit)
    for owner in holders:
        await slots.acquire(owner)
    served: list[str] = []

    async def wait(owner: str) -> None:
        await slots.acquire(owner)
        served.append(owner)

    tasks = [asyncio.create_task(wait(o)) for o in arrivals]
    await settle()
    assert served == []
    holding, seen = list(holders), 0
    while len(served) < len(arrivals):
        slots.release(holding.pop(0))
        await settle()
        holding += served[seen:]
        seen = len(served)
    await asyncio.gather(*tasks)
    return served


@pytest.mark.parametrize(
    ("limit", "holders", "arrivals", "expected"),
    [
        # B arrives behind five of A's: B is served at the first freed slot.
        (2, ["a", "a"], ["a"] * 5 + ["b"], ["b", "a", "a", "a", "a", "a"]),
        # One slot: A's freed slot leaves A holding none, as B; A waited longer, but
        # B is next, however many A has queued.
        (1, ["a"], ["a", "a", "a", "b"], ["a", "b", "a", "a"]),
        # Equals take turns, in the order they began waiting.
        (1, ["a"], ["b", "b", "c", "c"], ["b", "c", "b", "c"]),
        # The owner holding fewest slots first.
        (3, ["a", "a", "b"], ["a", "b", "c"], ["c", "a", "b"]),
        # One owner alone: first come, first served.
        (2, ["a", "a"], ["a", "a", "a"], ["a", "a", "a"]),
    ],
)
async def test_freed_slots_go_to_the_owner_holding_fewest(
    limit: int, holders: list[str], arrivals: list[str], expected: list[str]
) -> None:
    assert await grant_order(limit, holders, arrivals) == expected


async def test_free_slots_are_taken_at_once_and_counted() -> None:
    slots = FairSlots(3)
    for owner in ("a", "a", "b"):
        await slots.acquire(owner)
    assert (slots.used, slots.held) == (3, {"a": 2, "b": 1})
    for owner in ("a", "b", "a"):
        slots.release(owner)
    assert (slots.used, slots.held) == (0, {})


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    waiter = asyncio.create_task(slots.acquire("b"))
    await settle()
    assert slots.waiting("b") == 1
    waiter.cancel()
    await settle()
    assert slots.waiting("b") == 0
    slots.release("a")
    assert (slots.used, slots.held) == (0, {})


async def test_a_waiter_cancelled_once_handed_a_slot_passes_it_on() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    first = asyncio.create_task(slots.acquire("b"))
    second = asyncio.create_task(slots.acquire("c"))
    await settle()
    slots.release("a")  # handed to b, which has not run yet
    first.cancel()
    await settle()
    assert first.cancelled()
    await asyncio.wait_for(second, 1)
    assert (slots.used, slots.held) == (1, {"c": 1})


async def test_a_release_between_a_cancel_and_its_resumption_skips_the_waiter() -> None:
    """`cancel()` cancels the waiter's future at once; its task leaves the queue only
    when it next runs. A slot released in between went to the cancelled waiter, raised
    InvalidStateError and stayed taken for good."""
    slots = FairSlots(1)
    await slots.acquire("a")
    cancelled = asyncio.create_task(slots.acquire("b"))
    behind = asyncio.create_task(slots.acquire("c"))
    await settle()
    cancelled.cancel()
    slots.release("a")  # before `cancelled` has run again
    await asyncio.wait_for(behind, 1)
    assert cancelled.cancelled()
    assert (slots.used, slots.held, slots.waiting("b")) == (1, {"c": 1}, 0)
    slots.release("c")
    assert (slots.used, slots.held) == (0, {})


async def test_timeouts_on_the_wait_never_leak_slots() -> None:
    slots = FairSlots(2)

    async def use(owner: str, hold: float) -> None:
        try:
            async with asyncio.timeout(0.05):
                await slots.acquire(owner)
        except TimeoutError:
            return
        try:
            await asyncio.sleep(hold)
        finally:
            slots.release(owner)

    await asyncio.gather(*(use("abc"[i % 3], 0.01 * (i % 7)) for i in range(60)))
    assert (slots.used, slots.held, slots.waiting("a")) == (0, {}, 0)
