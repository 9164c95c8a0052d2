"""Affinity routing through the real gateway in front of four simulated engines.

Which engine served a request is read from the engines, never from the gateway: their
counters (`sim:received_requests_total`) and their request recorders, which show the
`X-Request-Id` each request arrived with. Engines run with zero latency: these tests
check where requests go, not how fast.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from bench.suites.routing.workloads import png_data_url
from gateway.routing.policy import Affinity, RoutingRequest
from gateway.routing.settings import RoutingSettings
from tests.procs import (
    Proc,
    client_request_id,
    gateway_proc,
    recording_engines,
    sim_received,
    wait_for,
)
from tests.unit.routing.test_policy import FakeEngine, laid_at_the_end, leading_nothing

KEY = "sk-routing-e2e-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _gateway(tmp: Path, engines: Sequence[str]) -> Proc:
    env = {
        "GATEWAY_ENGINES": json.dumps(list(engines)),
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_ROUTING__POLICY": "affinity",
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        "GATEWAY_ROUTING__SESSION_HEADER": "X-Session-Id",
    }
    proc = gateway_proc(tmp, env).start("/healthz")

    def lists_model() -> bool:
        r = HTTP.get(proc.url + "/v1/models", headers=HEADERS, timeout=5)
        return r.status_code == 200 and MODEL in r.text

    assert wait_for(lists_model, timeout=20), proc.log()
    return proc


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    with recording_engines(tmp_path_factory.mktemp("routing-e2e"), 4, record=1000) as sims:
        yield sims


@pytest.fixture(scope="module")
def gateway(engines: list[Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = _gateway(tmp_path_factory.mktemp("routing-gw"), [e.url for e in engines])
    try:
        yield proc
    finally:
        proc.stop()


def counts(engines: Sequence[Proc]) -> list[float]:
    return [sim_received(e.url) for e in engines]


def post(client: httpx.Client, gateway: Proc, body: dict[str, Any]) -> None:
    r = client.post(gateway.url + "/v1/chat/completions", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text


def send(
    client: httpx.Client,
    gateway: Proc,
    body: dict[str, Any],
    request_id: str,
    headers: dict[str, str] | None = None,
) -> None:
    r = client.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={**HEADERS, "X-Request-Id": request_id, **(headers or {})},
    )
    assert r.status_code == 200, r.text


def served(engines: Sequence[Proc]) -> dict[str, int]:
    """Request id -> index of the engine that received it, from the engines' recorders."""
    out: dict[str, int] = {}
    for index, engine in enumerate(engines):
        for entry in HTTP.get(engine.url + "/sim/requests", timeout=5).json():
            engine_id = entry["headers"].get("x-request-id")
            if entry["path"] == "/v1/chat/completions" and engine_id:
                request_id = client_request_id(engine_id)
                assert request_id not in out, "one request reached two engines"
                out[request_id] = index
    return out


def chat(system: str, *turns: str, media: str | None = None) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
        if media is not None and i == 0:
            content: Any = [
                {"type": "image_url", "image_url": {"url": media}},
                {"type": "text", "text": text},
            ]
        else:
            content = text
        messages.append({"role": "user", "content": content})
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


@pytest.mark.slow
def test_thirty_turns_of_a_conversation_reach_one_engine(
    gateway: Proc, engines: list[Proc]
) -> None:
    system = "You are the trip planner. " * 40
    with httpx.Client(timeout=10) as client:
        before = counts(engines)
        for turns in range(1, 31):
            post(client, gateway, chat(system, *(f"Step {t} of my trip." for t in range(turns))))
        delta = [a - b for a, b in zip(counts(engines), before, strict=True)]
    assert sorted(delta) == [0, 0, 0, 30]


# Conversations under one shared prompt. Where each lands follows from a hash over the
# engines' URLs, whose ports change every run: the share is a random draw, and with 100
# conversations one engine took 43 of them (1 in about 100 runs: the prompt's engine
# also takes those before the prompt turns hot). With 400 the 40% bound holds by a wide
# margin (about 1 run in 10^8) and still fails if one engine takes the hot prompt.
CONVERSATIONS = 400


@pytest.mark.slow
def test_conversations_under_one_prompt_spread_over_the_engines(
    gateway: Proc, engines: list[Proc]
) -> None:
    system = "You are the support desk of Acme. " * 40  # shared by all: becomes hot
    with httpx.Client(timeout=10) as client:
        before = counts(engines)
        for i in range(CONVERSATIONS):
            post(client, gateway, chat(system, f"Customer {i}: my order is late."))
        delta = [a - b for a, b in zip(counts(engines), before, strict=True)]
    assert sum(delta) == CONVERSATIONS
    assert max(delta) <= 0.4 * CONVERSATIONS, delta


@pytest.mark.slow
def test_questions_about_one_image_reach_one_engine(gateway: Proc, engines: list[Proc]) -> None:
    system = "You describe pictures. " * 30
    images = [png_data_url(1000 + i, side=64) for i in range(6)]
    with httpx.Client(timeout=10) as client:
        for i in range(40):  # the shared system prompt turns hot before the images come
            post(client, gateway, chat(system, f"Warm-up question {i}?"))
        for q in range(4):
            for i, url in enumerate(images):
                send(
                    client,
                    gateway,
                    chat(system, f"Question {q} about it?", media=url),
                    f"img-{i}-q{q}",
                )
    where = served(engines)
    homes = [{where[f"img-{i}-q{q}"] for q in range(4)} for i in range(len(images))]
    assert all(len(h) == 1 for h in homes), homes
    assert len({next(iter(h)) for h in homes}) >= 2


@pytest.mark.slow
def test_two_gateways_started_separately_choose_the_same_engines(
    engines: list[Proc], tmp_path: Path
) -> None:
    urls = [e.url for e in engines]
    # The second lists the engines in another order: only the URLs may matter.
    first = _gateway(tmp_path, urls)
    second = _gateway(tmp_path, list(reversed(urls)))
    system = "You are the billing assistant. " * 40
    bodies = [
        chat(system, *(f"Account {c}, question {t}." for t in range(turns)))
        for turns in (1, 2, 3)
        for c in range(8)
    ]
    bodies += [
        chat(system, "What is in it?", media=png_data_url(2000 + i, side=64)) for i in range(4)
    ]
    try:
        with httpx.Client(timeout=10) as client:
            for k, body in enumerate(bodies):
                send(client, first, body, f"pair-{k}-first")
                send(client, second, body, f"pair-{k}-second")
    finally:
        first.stop()
        second.stop()
    where = served(engines)
    picks_first = [where[f"pair-{k}-first"] for k in range(len(bodies))]
    picks_second = [where[f"pair-{k}-second"] for k in range(len(bodies))]
    assert picks_first == picks_second
    assert len(set(picks_first)) >= 3


@pytest.mark.slow
def test_a_session_header_keeps_different_prompts_on_one_engine(
    gateway: Proc, engines: list[Proc]
) -> None:
    # Different prompts (different anchors) that name the same session share an engine.
    with httpx.Client(timeout=10) as client:
        for s in range(8):
            for q in range(4):
                body = chat(f"Topic {q * 7919 + s} for you.", f"Unrelated question {q}-{s}?")
                send(client, gateway, body, f"session-{s}-{q}", {"X-Session-Id": f"s-{s}"})
        # Without the header the same prompts spread by their own anchors.
        for q in range(8):
            send(client, gateway, chat(f"Topic {q * 7919} for you.", f"Unrelated question {q}-0?"),
                 f"nosession-{q}")  # fmt: skip
    where = served(engines)
    homes = [{where[f"session-{s}-{q}"] for q in range(4)} for s in range(8)]
    assert all(len(h) == 1 for h in homes), homes
    assert len({next(iter(h)) for h in homes}) >= 2
    assert len({where[f"nosession-{q}"] for q in range(8)}) >= 2
    by_id: dict[str, dict[str, Any]] = {}

    def logged() -> bool:  # a request's line is written just after its response
        lines = [json.loads(x) for x in gateway.log().splitlines() if x.startswith("{")]
        by_id.update((x["request_id"], x) for x in lines if x.get("event") == "request")
        return "session-0-0" in by_id and "nosession-0" in by_id

    assert wait_for(logged, timeout=5)
    assert by_id["session-0-0"]["anchor_kind"] == "session"
    assert by_id["session-0-0"]["policy"] == "affinity"
    assert by_id["nosession-0"]["anchor_kind"] != "session"
    assert "s-0" not in json.dumps(by_id["session-0-0"])  # the session key is not logged


def _point_at_the_end_of_the_line(engines: int) -> tuple[list[str], str]:
    """A common prefix of two blocks and a new continuation of its first block, for
    which a fresh gateway's affinity lays the first block's anchor (hot, but leading
    nothing of its own: every request carrying it carries the second) as a point at the
    end of the line. Found by the policy in-process, so the case is the one the
    gateway meets whatever the anchors hash to."""
    pool = [FakeEngine(f"http://10.0.0.{i + 1}:8000") for i in range(engines)]
    for i in range(100):
        policy = Affinity(RoutingSettings())
        prompts, other = leading_nothing(i)
        for prompt in prompts:
            policy.order(RoutingRequest("/v1/completions", body=completion(prompt)), pool)
        if laid_at_the_end(policy):
            return prompts, other
    raise AssertionError("no prefix laid at the end of the line")


def completion(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2}


@pytest.mark.slow
def test_a_new_continuation_of_a_hot_prefix_is_served(engines: list[Proc], tmp_path: Path) -> None:
    """A hot prefix whose traffic a longer hot prefix leads entirely, laid at the end of
    the line of engines, then a request that carries it and continues otherwise: the
    gateway serves it from the line's last engine. It answered 500 while the end of the
    line was read as an engine past the last."""
    prompts, other = _point_at_the_end_of_the_line(len(engines))
    proc = _gateway(tmp_path, [e.url for e in engines])
    before = sum(counts(engines))
    try:
        with httpx.Client(timeout=10) as client:
            for prompt in prompts:
                r = client.post(
                    proc.url + "/v1/completions", json=completion(prompt), headers=HEADERS
                )
                assert r.status_code == 200, r.text
            r = client.post(proc.url + "/v1/completions", json=completion(other), headers=HEADERS)
    finally:
        proc.stop()
    assert r.status_code == 200, r.text
    assert sum(counts(engines)) == before + 13
