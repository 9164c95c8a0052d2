"""The decode budget (gateway/media/budget.py) and the decode pool that charges it
(gateway/media/decoder.py), in-process: order of service, cancellation, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bench.samples import png
from gateway.errors import MediaBusy, MediaInvalid
from gateway.media.budget import Budget
from gateway.media.decoder import Decoder
from gateway.media.images import decode_cost, read_header
from gateway.media.settings import MediaSettings, ValidationDepth


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


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
async def test_waiters_are_served_in_arrival_order(
    capacity: int,
    held: int,
    arrivals: list[int],
    served_before_release: list[int],
    served_after_release: list[int],
) -> None:
    budget = Budget(capacity)
    if held:
        await budget.acquire(held)
    served: list[int] = []

    async def take(index: int, amount: int) -> None:
        await budget.acquire(amount)
        served.append(index)

    tasks = [asyncio.create_task(take(i, a)) for i, a in enumerate(arrivals)]
    await _settle()
    assert served == served_before_release
    if held:
        budget.release(held)
    for i in served_before_release:
        budget.release(arrivals[i])
    await _settle()
    assert served == served_before_release + [
        i for i in served_after_release if i not in served_before_release
    ]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_cancelled_waiter_leaves_the_line_and_lets_the_next_through() -> None:
    budget = Budget(10)
    await budget.acquire(8)
    head = asyncio.create_task(budget.acquire(5))  # does not fit: blocks the line
    behind = asyncio.create_task(budget.acquire(2))  # would fit, waits behind the head
    await _settle()
    assert not behind.done() and budget.waiting == 2
    head.cancel()
    await _settle()
    assert behind.done() and behind.exception() is None
    assert budget.available == 0 and budget.waiting == 0


async def test_a_timeout_gives_up_the_place_and_takes_nothing() -> None:
    budget = Budget(10)
    await budget.acquire(10)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await budget.acquire(1)
    assert budget.waiting == 0
    budget.release(10)
    assert budget.available == 10


async def test_a_waiter_cancelled_after_its_grant_gives_the_grant_back() -> None:
    budget = Budget(10)
    await budget.acquire(10)
    waiter = asyncio.create_task(budget.acquire(4))
    await _settle()
    budget.release(10)  # grants the waiter's 4 before it has run again
    waiter.cancel()  # ...and it is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.available == 10 and budget.waiting == 0


async def test_a_release_skips_a_waiter_cancelled_before_it_resumed() -> None:
    # The decode_wait timeout (or a client leaving) cancels the waiter's future at once;
    # a decode ending in the same loop iteration released before the waiter resumed.
    # Granting it raised InvalidStateError in release, the waiter's own exit raised
    # ValueError (a 500), and its share was lost for good: seen through the gateway
    # under load (one attacker key, 24 clients of 8 large PNGs each, 45 s).
    budget = Budget(10)
    await budget.acquire(10)
    cancelled = asyncio.create_task(budget.acquire(6))
    behind = asyncio.create_task(budget.acquire(4))
    await _settle()
    cancelled.cancel()  # its future is cancelled; the task has not run yet
    budget.release(10)
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await _settle()
    assert behind.done() and behind.exception() is None
    assert budget.available == 6 and budget.waiting == 0
    budget.release(4)
    assert budget.available == 10


@pytest.mark.parametrize(
    ("capacity", "amount", "error"),
    [(0, 1, ValueError), (10, 11, ValueError)],
)
async def test_impossible_requests_are_errors(
    capacity: int, amount: int, error: type[Exception]
) -> None:
    with pytest.raises(error):
        budget = Budget(capacity)
        await budget.acquire(amount)


async def test_releasing_more_than_was_taken_is_an_error() -> None:
    budget = Budget(10)
    with pytest.raises(RuntimeError):
        budget.release(1)


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
        await decoder.decode(cost, decode_image, truncated, header, settings)
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

    holder = asyncio.create_task(decoder.decode(decoder.budget.capacity, slow))
    await asyncio.to_thread(started.wait, 5)
    with pytest.raises(MediaBusy) as caught:
        await decoder.decode(1, lambda: 2)
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

    caller = asyncio.create_task(decoder.decode(1000, slow))
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

    await asyncio.gather(*(decoder.decode(1, work) for _ in range(8)))
    assert most == 2
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
