"""Health checks (gateway/routing/checks.py) against a fake engine whose answers are
scripted: a check that times out once is sent again before it counts, because the timer
also runs out while the gateway's own event loop is held; one that times out twice takes
the engine out."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from gateway.routing.checks import EngineChecks
from gateway.routing.engine import Engine
from gateway.routing.settings import RoutingSettings
from gateway.upstream.errors import ConnectRefused
from tests.unit.engines import FakeEngine, FakeResponse, Sent

MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'


class ScriptedEngine(FakeEngine):
    """Answers GET /health by the script, one step a request: "ok", "hang" (never
    answers) or "refuse"; /v1/models always answers."""

    def __init__(self, script: Sequence[str]) -> None:
        self.script = list(script)
        self.health_requests = 0

    async def answer(self, sent: Sent) -> FakeResponse:
        if sent.target == "/v1/models":
            return FakeResponse(200, [MODELS], "application/json")
        self.health_requests += 1
        step = self.script.pop(0) if self.script else "ok"
        if step == "hang":
            await asyncio.sleep(3600)
        if step == "refuse":
            raise ConnectRefused("refused")
        return FakeResponse(200, [], "application/json")


SETTINGS = RoutingSettings(health_timeout=0.05, busy_grace=0)


async def checked(script: Sequence[str]) -> tuple[Engine, ScriptedEngine]:
    engine = Engine("http://127.0.0.1:9")
    upstream = ScriptedEngine(script)
    await EngineChecks(SETTINGS, upstream, []).check(engine)
    return engine, upstream


async def test_a_healthy_engine_is_checked_once() -> None:
    engine, upstream = await checked(["ok"])
    assert engine.healthy
    assert upstream.health_requests == 1


async def test_one_timed_out_check_is_sent_again_and_does_not_count() -> None:
    engine, upstream = await checked(["hang", "ok"])
    assert engine.healthy
    assert upstream.health_requests == 2


async def test_an_engine_that_times_out_twice_is_out() -> None:
    engine, upstream = await checked(["hang", "hang"])
    assert not engine.healthy
    assert engine.reason == "timeout"
    assert upstream.health_requests == 2


@pytest.mark.parametrize("script", [["refuse"], ["refuse", "ok"]])
async def test_a_refused_connection_counts_at_once(script: list[str]) -> None:
    engine, upstream = await checked(script)
    assert not engine.healthy
    assert upstream.health_requests == 1


class MetricsEngine(FakeEngine):
    """Answers GET /metrics with `running` requests, after this process has sent the
    engine `sent` requests and `ended` of its requests have ended while the scrape was
    on its way."""

    def __init__(self, engine: Engine, running: int, sent: int, ended: int) -> None:
        self.engine, self.running, self.sent, self.ended = engine, running, sent, ended

    async def answer(self, request: Sent) -> FakeResponse:
        assert request.target == "/metrics"
        self.engine.in_flight += self.sent - self.ended
        self.engine.sent += self.sent
        body = f"vllm:num_requests_running {self.running}\nvllm:num_requests_waiting 0\n"
        return FakeResponse(200, [body.encode()], "text/plain")


@pytest.mark.parametrize(
    ("before", "sent", "ended", "running", "mine", "busy_after_all_end"),
    [
        # Ours alone: once they end, the engine is idle for the store, busy for the bound.
        (2, 0, 0, 2, 2, 0),
        # One of ours ended while the scrape was on its way, counted or not: not taken
        # for another process's.
        (2, 0, 1, 2, 2, 0),
        (2, 0, 1, 1, 2, 0),
        # One of ours sent meanwhile, counted or not: likewise.
        (1, 1, 0, 2, 2, 0),
        (1, 1, 0, 1, 2, 0),
        # Another process's three, and one of ours.
        (0, 0, 0, 3, 0, 3),
        (1, 0, 0, 4, 1, 3),
    ],
)
async def test_a_scrape_records_how_many_of_its_requests_the_engine_may_have_counted(
    before: int, sent: int, ended: int, running: int, mine: int, busy_after_all_end: int
) -> None:
    engine = Engine("http://127.0.0.1:9")
    engine.in_flight = engine.sent = before
    scripted = MetricsEngine(engine, running, sent, ended)
    await EngineChecks(SETTINGS, scripted, []).scrape(engine)
    assert engine.scraped and engine.running == running
    assert engine.mine_at_scrape == mine
    engine.in_flight = 0
    assert engine.busy == busy_after_all_end
    assert engine.load == running
