"""The request body's pace (gateway/proxy/body.py, gateway/server/limits.py's BodyPace),
in process. Through the gateway under uvicorn: tests/e2e/test_connections.py."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.suites.parsed_memory import held, shapes
from gateway.config.settings import LimitsSettings, TimeoutSettings
from gateway.errors import RequestTimeout
from gateway.proxy import footprint
from gateway.proxy.body import read_body
from gateway.proxy.footprint import held_by, parsed_size
from gateway.server.limits import BodyPace, ConnectionGuard

PACE = BodyPace(deadline=60.0, grace=5.0, rate=1000.0)


@pytest.mark.parametrize(
    ("pace", "received", "due"),
    [
        (PACE, 0, 5.0),  # nothing yet: the grace
        (PACE, 1000, 6.0),  # 1,000 bytes buy a second after the grace
        (PACE, 25_000, 30.0),
        (PACE, 55_000, 60.0),  # never past the deadline
        (PACE, 10**9, 60.0),
        (BodyPace(deadline=60.0, grace=5.0, rate=0), 0, 60.0),  # no minimum rate
        (BodyPace(deadline=60.0, grace=5.0, rate=0), 10**9, 60.0),
    ],
)
def test_body_pace_due(pace: BodyPace, received: int, due: float) -> None:
    assert pace.due(received) == pytest.approx(due)


def _receive(script: list[tuple[float, bytes, bool]]) -> Any:
    """An ASGI receive that waits, then returns each (delay, body, more_body) in turn."""
    steps = iter(script)

    async def receive() -> dict[str, Any]:
        delay, body, more = next(steps)
        await asyncio.sleep(delay)
        return {"type": "http.request", "body": body, "more_body": more}

    return receive


def _guard() -> ConnectionGuard:
    """Bodies whole within 1.2 s, at 1,000 bytes a second after 0.4 s; swept every 0.1 s
    (a quarter of the grace)."""
    timeouts = TimeoutSettings(request_body=1.2, request_body_grace=0.4)
    return ConnectionGuard(timeouts, LimitsSettings(min_body_rate=1000))


@pytest.mark.parametrize(
    ("script", "outcome"),
    [
        ([(0, b"x" * 10, False)], b"x" * 10),  # whole at once
        ([(0.1, b"a", True), (0.1, b"b", False)], b"ab"),  # within the grace
        # 200 bytes buy 0.2 s past the grace (until 0.6 s); the rest came at 0.45 s.
        ([(0, b"a" * 200, True), (0.45, b"b", False)], b"a" * 200 + b"b"),
        ([(0.9, b"a", False)], "rate"),  # nothing within the grace
        ([(0, b"a" * 200, True), (1.0, b"b", False)], "rate"),  # behind from 0.6 s
        # 400 bytes a second is behind 1,000 from about 0.73 s.
        ([(0, b"a" * 50, True)] + [(0.1, b"a" * 40, True)] * 30, "rate"),
        # Ahead of the rate, but not whole by the deadline.
        ([(0, b"a" * 5000, True)] + [(0.2, b"a", True)] * 20, "deadline"),
    ],
)
def test_read_body_keeps_the_pace(script: list[tuple[float, bytes, bool]], outcome: Any) -> None:
    async def read() -> bytes:
        guard = _guard()
        try:
            return await read_body(_receive(script), 10**6, guard)
        finally:
            assert not guard.bodies and not guard.late
            guard.stop()

    if isinstance(outcome, bytes):
        assert asyncio.run(read()) == outcome
        return
    with pytest.raises(RequestTimeout) as caught:
        asyncio.run(read())
    assert caught.value.code == "request_timeout"
    assert ("bytes a second" in caught.value.message) == (outcome == "rate")


def test_read_body_lets_other_cancellations_through() -> None:
    async def scenario() -> None:
        guard = _guard()
        task = asyncio.create_task(read_body(_receive([(5, b"a", False)]), 100, guard))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not guard.bodies and not guard.late
        guard.stop()

    asyncio.run(scenario())


def test_the_body_reader_takes_the_loop_the_sweep_runs_on() -> None:
    guard = _guard()
    loops: list[asyncio.AbstractEventLoop] = []

    async def scenario() -> None:
        loops.append(asyncio.get_running_loop())
        # Not started yet: started here, on the running loop, and kept.
        assert guard.running_loop() is loops[-1]
        assert guard.running_loop() is loops[-1]
        guard.stop()

    asyncio.run(scenario())
    # Stopped, then used from another loop: it starts again there.
    asyncio.run(scenario())
    assert loops[0] is not loops[1]


@pytest.mark.parametrize("name", sorted(shapes(1)))
def test_the_parsed_body_charged_covers_what_the_parse_holds(name: str) -> None:
    """Every shape of bench/suites/parsed_memory.py, 20,000 values: the body budget's
    charge for the parsed object, walked (held_by) or bounded from the bytes
    (parsed_size), is at least what orjson.loads holds (tracemalloc)."""
    raw = shapes(20_000)[name]
    real = held(raw)
    assert parsed_size(raw) >= real
    assert held_by(orjson.loads(raw), raw) >= real


def _chat(system: str, question: str, reply: str = "") -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if reply:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 8})


@pytest.mark.parametrize(
    "raw",
    [
        _chat("You answer briefly. " * 300, "What is a prefix cache? " * 4),  # 6.3 KB
        _chat("s" * 2000, "q" * 100),  # just over WALK_OVER
        _chat("Be terse. " * 3000, "Why? " * 40, "Because. " * 500),  # 35 KB
        _chat("系统" * 1500, "问题" * 50),  # wide characters
        _chat("😀" * 800, "?"),  # characters past U+FFFF
    ],
)
def test_a_chat_of_few_long_messages_is_charged_by_its_walk(raw: bytes) -> None:
    """A body over WALK_OVER of few objects for its size (a chat's long system prompt)
    is walked, not counted from its bytes: charged at least what the parse holds
    (tracemalloc), and no more than the count's bound. On the code before (walked only
    over 64 KiB), the 6.3 KB chat was charged the count (8,056 bytes for 6,735 held)."""
    assert len(raw) > footprint.WALK_OVER
    charged = held_by(orjson.loads(raw), raw)
    assert held(raw) <= charged < parsed_size(raw)


@given(st.binary(max_size=512))
def test_parsed_size_counts_each_object_byte_of_any_body(raw: bytes) -> None:
    # The four bytes counted in one pass are each counted as a pass of its own would.
    f = footprint
    wide = not (raw.isascii() and raw.find(b"\\u") < 0)
    width = 1 if not wide else 4 if f._FOUR_BYTE_CHARS.search(raw) else 2
    header = f.PARSED_WIDE_HEADER if wide else 0
    expected = (
        width * len(raw)
        + f.PARSED_PER_LIST * raw.count(b"[")
        + f.PARSED_PER_DICT * raw.count(b"{")
        + (f.PARSED_PER_ITEM + header) * raw.count(b",")
        + (f.PARSED_PER_MEMBER + header) * raw.count(b":")
    )
    assert parsed_size(raw) == expected
