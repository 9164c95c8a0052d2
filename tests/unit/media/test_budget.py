"""The decode budget (gateway/media/budget.py) and the decode pool that charges it
(gateway/media/decoder.py), in-process: order of service between owners (keys) and
within one, the thread cap, cancellation, errors. Through the running gateway:
test_memory.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bench.harness.samples import png
from gateway.errors import MediaBusy, MediaInvalid
from gateway.media.budget import Budget
from gateway.media.decoder import Decoder
from gateway.media.images import decode_cost, read_header
from gateway.media.settings import MediaSettings
from gateway.media.types import ValidationDepth


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


THREADS = 100  # no thread cap where a case is about bytes


@pytest.mark.parametrize(
    ("capacity", "held", "arrivals", "served_before_release", "served_after_release"),
    [
        # Room for everyone: served at once, in order.
        (10, 0, [3, 3, 3], [0, 1, 2], [0, 1, 2]),
        # The head does not fit: nobody behind it is served, even one that would fit.
        (10, 8, [5, 1], [], [0, 1]),
        # The head fits, the next does not, the one after waits behind it (though it fits).
        (10, 6, [4, 9, 1], [0], [0, 1, 2]),
        # Exactly the capacity.
        (10, 0, [10, 1], [0], [0, 1]),
    ],
)
async def test_one_owners_waiters_are_served_in_arrival_order(
    capacity: int,
    held: int,
    arrivals: list[int],
    served_before_release: list[int],
    served_after_release: list[int],
) -> None:
    budget = Budget(capacity, THREADS)
    if held:
        await budget.acquire(held, "a")
    served: list[int] = []

    async def take(index: int, amount: int) -> None:
        await budget.acquire(amount, "a")
        served.append(index)

    tasks = [asyncio.create_task(take(i, a)) for i, a in enumerate(arrivals)]
    await _settle()
    assert served == served_before_release
    if held:
        budget.release(held, "a")
    for i in served_before_release:
        budget.release(arrivals[i], "a")
    await _settle()
    assert served == served_before_release + [
        i for i in served_after_release if i not in served_before_release
    ]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


Grant = tuple[str, int]  # an owner and the bytes it asks for


async def grant_rounds(
    capacity: int, threads: int, holders: list[Grant], arrivals: list[Grant]
) -> list[list[str]]:
    """`holders` take their grants, then `arrivals` queue in this order. Grants are then
    released one at a time, the longest held first. Each round lists the grants made
    (as owner and amount, "a50"): round 0 before any release, round n after the n-th."""
    budget = Budget(capacity, threads)
    for owner, amount in holders:
        await budget.acquire(amount, owner)
    served: list[Grant] = []

    async def wait(owner: str, amount: int) -> None:
        await budget.acquire(amount, owner)
        served.append((owner, amount))

    tasks = []
    for owner, amount in arrivals:
        tasks.append(asyncio.create_task(wait(owner, amount)))
        await _settle()  # arrival order is the order of the table
    rounds = [[f"{o}{a}" for o, a in served]]
    holding, seen = list(holders) + served, len(served)
    while len(served) < len(arrivals):
        budget.release(*holding.pop(0)[::-1])
        await _settle()
        rounds.append([f"{o}{a}" for o, a in served[seen:]])
        holding += served[seen:]
        seen = len(served)
    await asyncio.gather(*tasks)
    for owner, amount in holding:
        budget.release(amount, owner)
    assert (budget.available, budget.running, budget.held, budget.waiting) == (capacity, 0, {}, 0)
    return rounds


@pytest.mark.parametrize(
    ("capacity", "threads", "holders", "arrivals", "expected"),
    [
        # A holds both threads and has four decodes queued: B's one goes at the first
        # freed thread, then A's in arrival order.
        (100, 2, [("a", 10), ("a", 10)], [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 10)],
         [[], ["b10"], ["a1"], ["a2"], ["a3"], ["a4"]]),
        # The owner holding the fewest bytes first (not the fewest decodes: A and B run
        # one each, A waited longer, B holds less).
        (100, 3, [("c", 5), ("a", 30), ("b", 10)], [("a", 5), ("b", 5)],
         [[], ["b5"], ["a5"]]),
        # Equals take turns, in the order they began waiting.
        (100, 1, [("x", 10)], [("b", 1), ("b", 2), ("c", 1), ("c", 2)],
         [[], ["b1"], ["c1"], ["b2"], ["c2"]]),
        # Bytes to spare but no thread: waits for one.
        (100, 2, [("a", 1), ("a", 1)], [("b", 1)], [[], ["b1"]]),
        # No starvation: A's 50 is next (A holds nothing) and does not fit; B's and C's
        # 5 fit, and a thread is free, but wait behind it until it is served.
        (100, 4, [("b", 30), ("b", 30), ("c", 30)], [("a", 50), ("b", 5), ("c", 5)],
         [[], [], ["a50", "b5", "c5"]]),
        # ...but an owner holding less than the one waiting goes first, at once, when it
        # fits: B (30 against A's 60), then C (nothing held).
        (100, 4, [("a", 60), ("b", 30)], [("a", 50), ("b", 5), ("c", 5)],
         [["b5", "c5"], ["a50"]]),
        # One owner alone: first come, first served.
        (10, 2, [("a", 6)], [("a", 5), ("a", 1)], [[], ["a5", "a1"]]),
    ],
)  # fmt: skip
async def test_grants_go_to_the_owner_holding_fewest_bytes(
    capacity: int,
    threads: int,
    holders: list[Grant],
    arrivals: list[Grant],
    expected: list[list[str]],
) -> None:
    assert await grant_rounds(capacity, threads, holders, arrivals) == expected


async def test_a_cancelled_waiter_leaves_the_line_and_lets_the_next_through() -> None:
    budget = Budget(10, THREADS)
    await budget.acquire(8, "a")
    head = asyncio.create_task(budget.acquire(5, "b"))  # next, does not fit: blocks the line
    behind = asyncio.create_task(budget.acquire(2, "a"))  # would fit, waits behind it
    await _settle()
    assert not behind.done() and budget.waiting == 2
    head.cancel()
    await _settle()
    assert behind.done() and behind.exception() is None
    assert budget.available == 0 and budget.waiting == 0


async def test_a_timeout_gives_up_the_place_and_takes_nothing() -> None:
    budget = Budget(10, THREADS)
    await budget.acquire(10, "a")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await budget.acquire(1, "b")
    assert budget.waiting == 0
    budget.release(10, "a")
    assert (budget.available, budget.running, budget.held) == (10, 0, {})


async def test_a_waiter_cancelled_after_its_grant_gives_back_bytes_and_thread() -> None:
    budget = Budget(10, 1)
    await budget.acquire(10, "a")
    waiter = asyncio.create_task(budget.acquire(4, "b"))
    other = asyncio.create_task(budget.acquire(4, "c"))
    await _settle()
    budget.release(10, "a")  # grants b's 4 and the thread before b has run again
    waiter.cancel()  # ...and it is cancelled before it resumes: both go on to c
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(other, 1)
    assert (budget.available, budget.running, budget.held) == (6, 1, {"c": 4})
    budget.release(4, "c")
    assert (budget.available, budget.running, budget.held, budget.waiting) == (10, 0, {}, 0)


async def test_a_release_between_a_cancel_and_its_resumption_skips_the_waiter() -> None:
    """`cancel()` cancels the waiter's future at once; its task leaves the line only
    when it next runs. A release in between granted the cancelled waiter, raised
    InvalidStateError, the waiter's own exit a ValueError (a 500), and its share was
    lost for good: seen through the gateway under load (one key, 24 clients of 8 large
    PNGs each, 45 s)."""
    budget = Budget(10, THREADS)
    await budget.acquire(10, "a")
    cancelled = asyncio.create_task(budget.acquire(4, "b"))
    behind = asyncio.create_task(budget.acquire(4, "c"))
    await _settle()
    cancelled.cancel()
    budget.release(10, "a")  # before `cancelled` has run again
    await asyncio.wait_for(behind, 1)
    assert cancelled.cancelled()
    assert (budget.available, budget.running, budget.held, budget.waiting) == (6, 1, {"c": 4}, 0)


async def test_timeouts_on_the_wait_never_leak_budget() -> None:
    budget = Budget(10, 2)

    async def use(owner: str, amount: int, hold: float) -> None:
        try:
            async with asyncio.timeout(0.05):
                await budget.acquire(amount, owner)
        except TimeoutError:
            return
        try:
            await asyncio.sleep(hold)
        finally:
            budget.release(amount, owner)

    await asyncio.gather(*(use("abc"[i % 3], 1 + i % 6, 0.01 * (i % 7)) for i in range(60)))
    assert (budget.available, budget.running, budget.held, budget.waiting) == (10, 0, {}, 0)


@pytest.mark.parametrize(
    ("capacity", "threads", "amount"),
    [(0, 1, 1), (10, 0, 1), (10, 1, 11), (10, 1, 0)],
)
async def test_impossible_requests_are_errors(capacity: int, threads: int, amount: int) -> None:
    with pytest.raises(ValueError):
        budget = Budget(capacity, threads)
        await budget.acquire(amount, "a")


@pytest.mark.parametrize("owner", ["a", "b"])
async def test_releasing_more_than_was_taken_is_an_error(owner: str) -> None:
    budget = Budget(10, THREADS)
    await budget.acquire(2, "a")
    with pytest.raises(RuntimeError):
        budget.release(3 if owner == "a" else 1, owner)


# --- the decode pool --------------------------------------------------------------------


def _decoder(**settings: object) -> Decoder:
    return Decoder(MediaSettings.model_validate(settings))


async def test_a_failed_decode_gives_its_budget_back() -> None:
    decoder = _decoder(decode_wait=1.0)
    settings = MediaSettings()
    truncated = png(64, 64)[:-30]
    header = await decoder.run(read_header, truncated, "image/png", settings)
    cost = decode_cost(header, ValidationDepth.decode)
    from gateway.media.images import decode_image

    with pytest.raises(MediaInvalid):
        await decoder.decode(cost, "a", decode_image, truncated, header, settings)
    await _settle()
    assert decoder.budget.available == decoder.budget.capacity
    await decoder.aclose()


async def test_a_decode_that_cannot_get_its_budget_in_time_is_media_busy() -> None:
    decoder = _decoder(decode_wait=0.05)
    started, finish = threading.Event(), threading.Event()

    def slow() -> int:
        started.set()
        finish.wait(5)
        return 1

    holder = asyncio.create_task(decoder.decode(decoder.budget.capacity, "a", slow))
    await asyncio.to_thread(started.wait, 5)
    with pytest.raises(MediaBusy) as caught:
        await decoder.decode(1, "b", lambda: 2)
    assert caught.value.status == 503 and caught.value.code == "media_busy"
    assert caught.value.headers["Retry-After"] == "1"
    finish.set()
    assert await holder == 1
    await _settle()
    assert decoder.budget.available == decoder.budget.capacity
    await decoder.aclose()


async def test_a_cancelled_caller_keeps_the_budget_until_its_decode_has_ended() -> None:
    """The thread cannot be stopped: its memory is held until it returns."""
    decoder = _decoder()
    started, finish = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        finish.wait(5)

    caller = asyncio.create_task(decoder.decode(1000, "a", slow))
    await asyncio.to_thread(started.wait, 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert decoder.budget.available == decoder.budget.capacity - 1000
    finish.set()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if decoder.budget.available == decoder.budget.capacity:
            break
    assert decoder.budget.available == decoder.budget.capacity
    await decoder.aclose()


async def test_the_pool_runs_at_most_decode_threads_at_once() -> None:
    decoder = _decoder(decode_threads=2)
    lock = threading.Lock()
    running = most = 0

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        threading.Event().wait(0.05)
        with lock:
            running -= 1

    await asyncio.gather(*(decoder.decode(1, "ab"[i % 2], work) for i in range(8)))
    assert most == 2
    await decoder.aclose()


async def test_decodes_past_the_thread_count_wait_in_the_fair_line() -> None:
    """Not in the pool's own first-come-first-served queue, where the line could no
    longer choose who decodes next."""
    decoder = _decoder(decode_threads=2)
    started, finish = threading.Semaphore(0), threading.Event()

    def work() -> None:
        started.release()
        finish.wait(5)

    tasks = [asyncio.create_task(decoder.decode(1, "a", work)) for _ in range(5)]
    for _ in range(2):
        assert await asyncio.to_thread(started.acquire, True, 5)
    await _settle()
    assert (decoder.budget.running, decoder.budget.waiting) == (2, 3)
    finish.set()
    await asyncio.gather(*tasks)
    await _settle()
    assert (decoder.budget.running, decoder.budget.available) == (0, decoder.budget.capacity)
    await decoder.aclose()


@pytest.mark.parametrize(
    ("settings", "valid"),
    [
        ({}, True),
        # The budget must hold the costliest single item the other settings allow.
        ({"decode_budget_bytes": 100 * 2**20}, False),
        ({"decode_budget_bytes": 100 * 2**20, "image_formats": ["PNG"], "max_frames": 1}, True),
        ({"decode_budget_bytes": 100 * 2**20, "validation": "header"}, True),
        ({"max_pixels": 40_000_000}, False),
    ],
)
def test_the_budget_must_hold_the_largest_item(settings: dict[str, object], valid: bool) -> None:
    if valid:
        MediaSettings.model_validate(settings)
    else:
        with pytest.raises(ValueError, match="decode_budget_bytes"):
            MediaSettings.model_validate(settings)
