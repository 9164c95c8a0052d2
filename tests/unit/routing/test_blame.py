"""Whose failure is it, as tables: which runs of failed answers eject an engine
(gateway/routing/pool.py, `failed`), when a key is throttled for its engine errors
(gateway/routing/key_errors.py), and when a slow check leaves the last engine in
rotation (gateway/routing/checks.py, `_busy`). Through real processes:
tests/e2e/test_engine_blame.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.errors import TooManyEngineErrors
from gateway.routing.checks import EngineChecks
from gateway.routing.engine import Engine
from gateway.routing.key_errors import KeyErrors
from gateway.routing.model_list import ModelList
from gateway.routing.pool import EnginePool
from gateway.routing.settings import RoutingSettings
from tests.unit.engines import FakeEngine, FakeResponse, Sent

# A failure: (status, key); status None is a timeout or a broken answer, key None a
# caller without a key.
Failure = tuple[int | None, str | None]

RUNS: list[tuple[str, list[Failure], bool]] = [
    ("one key's 501s", [(501, "a")] * 20, False),
    ("one key's 500s", [(500, "a")] * 20, False),
    ("one key's 502s and 503s", [(502, "a"), (503, "a")] * 5, False),
    ("two keys' 501s", [(501, "a"), (501, "b")] * 10, False),
    ("500s over two keys", [(500, "a"), (500, "b"), (500, "a"), (500, "a"), (500, "a")], True),
    ("four 500s over two keys", [(500, "a"), (500, "b")] * 2, False),
    ("501s neither count nor end a run", [(500, "a"), (501, "b")] * 4, False),
    ("501s between five 500s over two keys", [(500, "a"), (501, "b")] * 4 + [(500, "b")], True),
    ("one key's run, then another key's 500", [(500, "a")] * 9 + [(500, "b")], True),
    ("one key's timeouts", [(None, "a")] * 20, False),
    ("timeouts over two keys", [(None, "a")] * 4 + [(None, "b")], True),
    ("one key's 500s and a timeout", [(500, "a")] * 4 + [(None, "a")], False),
    ("one key's 500s, another's timeout", [(500, "a")] * 4 + [(None, "b")], True),
    ("keyless timeouts", [(None, None)] * 20, False),
    ("keyless timeouts and a key's", [(None, None)] * 4 + [(None, "a")], True),
]


def _pool(**settings: Any) -> tuple[EnginePool, Engine]:
    pool = EnginePool(["http://127.0.0.1:9"], RoutingSettings(**settings), upstream=FakeEngine())
    (engine,) = pool.engines
    engine.healthy = True
    return pool, engine


@pytest.mark.parametrize(("label", "run", "ejected"), RUNS, ids=[r[0] for r in RUNS])
def test_which_runs_eject(label: str, run: list[Failure], ejected: bool) -> None:
    pool, engine = _pool()
    for status, key in run:
        pool.failed(engine, "" if key is None else key, status)
    assert (not engine.healthy) == ejected
    assert engine.ejections == int(ejected)
    if ejected:
        assert engine.reason == "ejected_5xx"


def test_keyless_callers_share_one_name_and_never_eject_alone() -> None:
    # The forwarder passes "" for a request without a key: one caller, like a key.
    pool, engine = _pool()
    for _ in range(10):
        pool.failed(engine, "", 500)
    assert engine.healthy


def test_an_answer_below_500_ends_the_run_and_its_keys() -> None:
    pool, engine = _pool()
    for key in ("a", "b", "a"):
        pool.failed(engine, key, 500)
    pool.failed(engine, "b")
    assert engine.unanswered
    pool.succeeded(engine)
    assert (engine.failures, engine.failing_keys, engine.unanswered) == (0, set(), False)
    for _ in range(4):
        pool.failed(engine, "a", 500)
    pool.failed(engine, "a", 500)
    assert engine.healthy


def test_eject_keys_one_is_the_old_rule_and_keys_held_are_bounded() -> None:
    pool, engine = _pool(eject_keys=1)
    for _ in range(5):
        pool.failed(engine, "a", 500)
    assert not engine.healthy
    pool, engine = _pool(eject_keys=3, eject_after_5xx=1000)
    for i in range(100):
        pool.failed(engine, f"key-{i}", 500)
    assert len(engine.failing_keys) == 3


# --- the key throttle ---------------------------------------------------------------


class Logger:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Shared:
    """A store's count: what other processes added, plus this one's adds."""

    def __init__(self, others: int = 0) -> None:
        self.others = others
        self.added: list[tuple[str, float]] = []

    async def add(self, client: str, window: float) -> int | None:
        self.added.append((client, window))
        return self.others + len(self.added)


def _errors(
    limit: int = 3, shared: Shared | None = None, now: float = 1000.5
) -> tuple[KeyErrors, Clock, Logger]:
    clock, log = Clock(now), Logger()
    return KeyErrors(limit, 60.0, logger=log, shared=shared, clock=clock), clock, log


async def test_a_key_is_throttled_at_its_limit_until_the_window_ends() -> None:
    errors, clock, log = _errors()
    for _ in range(2):
        await errors.failed("a")
        errors.check("a")
    await errors.failed("a")
    with pytest.raises(TooManyEngineErrors) as raised:
        errors.check("a")
    # 1000.5 s: the window [960, 1020) ends in 19.5 s.
    assert raised.value.headers == {"Retry-After": "20"}
    assert (raised.value.status, raised.value.code) == (429, "too_many_engine_errors")
    errors.check("b")  # another key goes on
    errors.check(None)  # a caller without a key is not throttled
    with pytest.raises(TooManyEngineErrors):
        errors.check("a")
    assert [line["event"] for line in log.lines] == ["key_engine_errors_throttled"]
    assert log.lines[0]["key"] == "a" and log.lines[0]["errors"] == 3
    clock.now = 1020.0  # the next window
    errors.check("a")
    await errors.failed("a")
    errors.check("a")


async def test_a_keyless_failure_is_not_counted() -> None:
    errors, _, _ = _errors(limit=1)
    await errors.failed(None)
    errors.check(None)
    assert errors.counts.windows == {}


async def test_the_store_count_throttles_a_key_other_processes_counted() -> None:
    shared = Shared(others=5)
    errors, _, _ = _errors(limit=3, shared=shared)
    await errors.failed("a")
    with pytest.raises(TooManyEngineErrors):
        errors.check("a")
    # Counted apart from client addresses (the same store script counts those).
    assert shared.added == [("key:a", 60.0)]


async def test_a_store_that_cannot_answer_leaves_the_local_count() -> None:
    class Down(Shared):
        async def add(self, client: str, window: float) -> int | None:
            return None

    errors, _, _ = _errors(limit=2, shared=Down())
    await errors.failed("a")
    errors.check("a")
    await errors.failed("a")
    with pytest.raises(TooManyEngineErrors):
        errors.check("a")


# --- slow checks and the last engine -------------------------------------------------


class Hanging(FakeEngine):
    """Answers /v1/models; GET /health never answers."""

    async def answer(self, sent: Sent) -> FakeResponse:
        if sent.target == "/v1/models":
            models = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
            return FakeResponse(200, [models], "application/json")
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


SLOW_CASES: list[tuple[str, bool, int, float | None, bool]] = [
    # label, sole, in flight, answered this many seconds ago (None: never), stays;
    # "timed out": the run of failures holds a request the engine never answered
    ("sole, answered just now", True, 0, 0.0, True),
    ("sole, a request in flight", True, 1, None, True),
    ("sole, idle past busy_grace", True, 0, 20.0, False),
    ("sole, never answered", True, 0, None, False),
    ("not sole, answered just now", False, 0, 0.0, False),
    ("not sole, a request in flight", False, 1, None, True),
    ("sole, answered just now, then a request timed out", True, 0, 0.0, False),
    ("sole, in flight, after a request timed out", True, 1, 0.0, False),
    ("not sole, in flight, after a request timed out", False, 1, None, False),
]


@pytest.mark.parametrize(
    ("label", "sole", "in_flight", "ago", "stays"), SLOW_CASES, ids=[c[0] for c in SLOW_CASES]
)
async def test_a_slow_check_and_the_last_engine(
    label: str, sole: bool, in_flight: int, ago: float | None, stays: bool
) -> None:
    settings = RoutingSettings(health_timeout=0.02, busy_grace=10.0)
    engine = Engine("http://127.0.0.1:9")
    engine.healthy, engine.reason, engine.detail = True, None, None
    engine.models_at = time.monotonic()
    engine.in_flight = in_flight
    if ago is not None:
        engine.answered_at = time.monotonic() - ago
    if "timed out" in label:
        pool = EnginePool([engine.url], settings, upstream=FakeEngine())
        pool.failed(engine, "a")
    checks = EngineChecks(settings, Hanging(), [], sole=lambda e: sole)
    await checks.check(engine)
    assert engine.healthy == stays
    if not stays:
        assert engine.reason == "timeout"


async def test_the_last_engine_stays_however_long_its_checks_time_out() -> None:
    settings = RoutingSettings(health_timeout=0.02, busy_grace=10.0)
    engine = Engine("http://127.0.0.1:9")
    engine.healthy, engine.reason, engine.detail = True, None, None
    engine.models_at = time.monotonic()
    checks = EngineChecks(settings, Hanging(), [], sole=lambda e: True)
    engine.answered_at = time.monotonic()
    await checks.check(engine)
    assert engine.slow_since is not None
    engine.slow_since -= 3600  # timing out for an hour, still answering requests
    await checks.check(engine)
    assert engine.healthy


def test_sole_means_no_other_engine_in_rotation_serves_its_models() -> None:
    pool = EnginePool(
        ["http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"],
        RoutingSettings(),
        upstream=FakeEngine(),
    )
    a, b, c = pool.engines
    for engine, model in ((a, "m"), (b, "m"), (c, "n")):
        engine.healthy = True
        engine.listing = ModelList(ids=frozenset([model]), default=model)
    pool._changed()
    assert not pool._sole(a) and not pool._sole(b) and pool._sole(c)
    b.healthy = False
    pool._changed()
    assert pool._sole(a)
