"""Per-key usage metrics through a running gateway and simulated engine: after a known
set of requests, the gateway's /metrics counts exactly those requests under each key's
name, and exactly the prompt and completion tokens the engine reported (non-streamed
answers, and streams, asked for with `stream_options.include_usage` or not). Each shape of
answer on its own: tests/e2e/test_metering.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import Proc, auth, error_code, gateway_proc, scrape, sim_proc, total, wait_for

ALICE = "sk-usage-alice-0123456789-SECRET"
BOB = "sk-usage-bob-0123456789-SECRET"
CAROL = "sk-usage-carol-0123456789-SECRET"
SCRAPER = "sk-usage-scraper-0123456789-SECRET"
WRONG = "sk-usage-not-configured-0123456789"


@dataclass
class Stack:
    sim: Proc
    gateway: Proc
    # A pooling engine, behind its own gateway.
    pooling: Proc
    pooling_gateway: Proc

    def metric(self, name: str, **labels: str) -> float:
        return scraped(self.gateway, name, **labels)


def scraped(gateway: Proc, name: str, **labels: str) -> float:
    """The sum of `name`'s samples with these labels on `gateway`'s /metrics."""
    return total(scrape(gateway.url + "/metrics", auth(SCRAPER)), name, **labels)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("usage")
    sim = sim_proc(tmp, "--latency", "zero")
    pooling = sim_proc(tmp, "--runner", "pooling", "--latency", "zero")
    keys = [
        {"key": ALICE, "name": "alice"},
        {"key": BOB, "name": "bob"},
        {"key": CAROL, "name": "carol"},
        {"key": SCRAPER, "name": "scraper", "scopes": ["metrics"]},
    ]
    gateway = gateway_proc(
        tmp, {"GATEWAY_ENGINES": json.dumps([sim.url]), "GATEWAY_API_KEYS": json.dumps(keys)}
    )
    pooling_gateway = gateway_proc(
        tmp, {"GATEWAY_ENGINES": json.dumps([pooling.url]), "GATEWAY_API_KEYS": json.dumps(keys)}
    )
    procs = (sim, pooling, gateway, pooling_gateway)
    try:
        for proc in procs:
            proc.start("/healthz" if proc in (gateway, pooling_gateway) else "/health")
        for gw in (gateway, pooling_gateway):
            assert wait_for(lambda gw=gw: HTTP.get(gw.url + "/readyz").status_code == 200)
        yield Stack(sim, gateway, pooling, pooling_gateway)
    finally:
        for proc in procs:
            proc.stop()


def chat(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


def streamed_usage(client: httpx.Client, key: str, body: dict[str, object]) -> dict | None:
    """Stream `body`, return the usage of its last data event before [DONE] (None)."""
    usage = None
    events = []
    with client.stream("POST", "/v1/chat/completions", headers=auth(key), json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    assert len(events) > 2
    usage = events[-1].get("usage")
    assert all("usage" not in e or e["usage"] is None for e in events[:-1])
    return usage


@pytest.mark.slow
def test_usage_and_requests_are_counted_per_key(stack: Stack) -> None:
    reported: dict[str, list[int]] = {"alice": [0, 0], "bob": [0, 0]}

    def add(name: str, usage: dict) -> None:
        reported[name][0] += usage["prompt_tokens"]
        reported[name][1] += usage.get("completion_tokens") or 0

    with httpx.Client(base_url=stack.gateway.url, timeout=30) as client:
        # alice: 3 answers, 2 streams with usage, 1 stream without, 1 completion.
        for i in range(3):
            r = client.post(
                "/v1/chat/completions", headers=auth(ALICE), json=chat(f"question {i} " * (i + 1))
            )
            assert r.status_code == 200
            add("alice", r.json()["usage"])
        for i in range(2):
            body = chat(f"stream {i}", stream=True, stream_options={"include_usage": True})
            usage = streamed_usage(client, ALICE, body)
            assert usage is not None
            add("alice", usage)
        # A stream asked without usage is metered all the same (the gateway asks the
        # engine for it): what the engine reports for it when asked directly.
        assert streamed_usage(client, ALICE, chat("no usage", stream=True)) is None
        with httpx.Client(base_url=stack.sim.url, timeout=30) as engine:
            asked = chat("no usage", stream=True, stream_options={"include_usage": True})
            usage = streamed_usage(engine, ALICE, asked)
        assert usage is not None
        add("alice", usage)
        r = client.post(
            "/v1/completions",
            headers=auth(ALICE),
            json={"model": MODEL, "prompt": ["one", "two two"], "max_tokens": 5},
        )
        assert r.status_code == 200
        add("alice", r.json()["usage"])
        # bob: 2 answers, one refused request of his own (a blocked route).
        for i in range(2):
            r = client.post(
                "/v1/chat/completions",
                headers=auth(BOB),
                json=chat(f"bob asks {i}", max_tokens=3 + i),
            )
            assert r.status_code == 200
            add("bob", r.json()["usage"])
        r = client.post("/v1/load_lora_adapter", headers=auth(BOB), json={"lora_name": "x"})
        assert (r.status_code, error_code(r)) == (403, "endpoint_blocked")
        # No valid key: counted under the fixed empty name.
        r = client.post("/v1/chat/completions", headers=auth(WRONG), json=chat("who"))
        assert (r.status_code, error_code(r)) == (401, "invalid_api_key")

    assert stack.metric("gateway_prompt_tokens_total", key="alice") == reported["alice"][0]
    assert stack.metric("gateway_completion_tokens_total", key="alice") == reported["alice"][1]
    assert stack.metric("gateway_prompt_tokens_total", key="bob") == reported["bob"][0]
    assert stack.metric("gateway_completion_tokens_total", key="bob") == reported["bob"][1]
    assert reported["alice"][1] > 0 and reported["bob"][1] > 0
    # Every answer counts its tokens: the totals are the engine's.
    assert stack.metric("gateway_prompt_tokens_total") == sum(p for p, _ in reported.values())

    ok = {"status": "200", "code": ""}
    assert stack.metric("gateway_requests_total", key="alice", group="inference", **ok) == 7
    assert stack.metric("gateway_requests_total", key="bob", group="inference", **ok) == 2
    blocked = {"group": "blocked", "status": "403", "code": "endpoint_blocked"}
    assert stack.metric("gateway_requests_total", key="bob", **blocked) == 1
    unknown = {"group": "inference", "status": "401", "code": "invalid_api_key"}
    assert stack.metric("gateway_requests_total", key="", **unknown) == 1
    # Open routes (the probes) carry the same fixed label.
    assert stack.metric("gateway_requests_total", key="", group="local") >= 1
    # Keys only ever appear as their names.
    text = HTTP.get(stack.gateway.url + "/metrics", headers=auth(SCRAPER)).text
    for secret in (ALICE, BOB, CAROL, SCRAPER, WRONG):
        assert secret not in text


@pytest.mark.slow
def test_pooling_usage_counts_prompt_tokens(stack: Stack) -> None:
    body = {"model": MODEL, "input": ["a b c", "d e f g", "h"]}
    r = HTTP.post(stack.pooling_gateway.url + "/v1/embeddings", headers=auth(BOB), json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 0 and not usage.get("completion_tokens")
    gateway = stack.pooling_gateway
    assert scraped(gateway, "gateway_prompt_tokens_total", key="bob") == usage["prompt_tokens"]
    assert scraped(gateway, "gateway_completion_tokens_total", key="bob") == 0


@pytest.mark.slow
def test_a_scrape_is_counted_under_the_scrapers_name(stack: Stack) -> None:
    before = stack.metric("gateway_requests_total", key="scraper", group="metrics")
    assert wait_for(
        lambda: stack.metric("gateway_requests_total", key="scraper", group="metrics") > before
    )


@pytest.mark.slow
def test_usage_followed_by_a_long_field_is_counted(stack: Stack) -> None:
    # vLLM writes what the client asks for after `usage`: the rendered prompt
    # (`return_prompt_text`), prompt logprobs, a Responses answer's `user`. A 6 KB prompt
    # put the answer's usage more than 4 KiB from its end, and it counted no tokens.
    body = chat("tell me " * 750, return_prompt_text=True)
    r = HTTP.post(stack.gateway.url + "/v1/chat/completions", headers=auth(CAROL), json=body)
    assert r.status_code == 200, r.text
    answer = r.content
    assert len(answer) - answer.rindex(b'"usage":') > 4096
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 0
    assert wait_for(
        lambda: stack.metric("gateway_prompt_tokens_total", key="carol") == usage["prompt_tokens"]
    )
    completion = stack.metric("gateway_completion_tokens_total", key="carol")
    assert completion == usage["completion_tokens"]
