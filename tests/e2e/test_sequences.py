"""A request counts as the engine sequences it makes the engine run (prompts x `n`, batch
conversations), against the key's in-flight cap and rate: the gateway under uvicorn in
front of a simulated engine.

- A key capped at 1 in flight and 1 request/s cannot put a 256-prompt completion or an
  `n: 64` chat into the engine (it could fill vLLM's whole `max_num_seqs` with one).
- A batch of 3,000 conversations is refused (`limits.max_sequences_per_request`).
- The in-flight cap and the rate count sequences, not HTTP requests.
Every refusal: status, code, and nothing reached the engine (its own counters). With the
store, across replicas: tests/store/test_shared_sequences.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    error_code,
    gateway_proc,
    held_streams,
    metric,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

pytestmark = pytest.mark.slow

UPSTREAM = "upstream-sequences-0123456789"
PLAIN = "sk-seq-plain-0123456789abcdef"
ONE = "sk-seq-one-0123456789abcdef"
CAPPED = "sk-seq-capped-0123456789abcdef"
RATED = "sk-seq-rated-0123456789abcdef"
KEY_CAP = 8
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# A generation that streams for a long while: it holds its sequences until closed.
LONG = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}


def completion(prompts: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [f"p{i}" for i in range(prompts)], "max_tokens": 1, **extra}


@dataclass
class Stack:
    sim: Proc
    gateway: Proc

    def post(self, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
        return HTTP.post(self.gateway.url + path, json=body, headers=auth(key), timeout=30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("sequences")
    keys = [
        {"key": PLAIN, "name": "plain"},
        # The attacker: 1 in flight, 1 request per second.
        {"key": ONE, "name": "one", "max_in_flight": 1, "rate": {"requests_per_second": 1}},
        {"key": CAPPED, "name": "capped", "max_in_flight": KEY_CAP},
        # A token every 20 s: within a test, its burst of 8 and nothing more.
        {"key": RATED, "name": "rated", "rate": {"requests_per_second": 0.05, "burst": 8}},
    ]
    with running(sim_proc(tmp, "--api-key", UPSTREAM)) as (sim,):
        env = {
            "GATEWAY_ENGINES": json.dumps([sim.url]),
            "GATEWAY_UPSTREAM_API_KEY": UPSTREAM,
            "GATEWAY_API_KEYS": json.dumps(keys),
            "GATEWAY_PUBLIC_METRICS": "true",
        }
        gateway = gateway_proc(tmp, env)
        gateway.start("/healthz")
        try:
            ready = lambda: HTTP.get(gateway.url + "/readyz").status_code == 200  # noqa: E731
            assert wait_for(ready, 20), gateway.log()
            yield Stack(sim, gateway)
        finally:
            gateway.stop()


def refused(resp: httpx.Response) -> tuple[int, str | None, str | None]:
    param = resp.json()["error"].get("param") if resp.status_code >= 400 else None
    return resp.status_code, error_code(resp), param


def test_a_key_capped_at_one_cannot_put_many_sequences_into_the_engine(stack: Stack) -> None:
    """256 prompts, or n: 64, from a key that may run one sequence at once: 400
    too_many_sequences, before the engine. A request of one sequence still passes."""
    before = sim_received(stack.sim.url)
    prompts = stack.post("/v1/completions", ONE, completion(256))
    assert refused(prompts) == (400, "too_many_sequences", "prompt"), prompts.text
    assert "256 sequences" in prompts.json()["error"]["message"]
    assert "retry-after" not in prompts.headers
    time.sleep(1.1)  # the key's next token (the refused request took the one it had)
    samples = stack.post("/v1/chat/completions", ONE, {**CHAT, "n": 64})
    assert refused(samples) == (400, "too_many_sequences", "n"), samples.text
    time.sleep(1.1)
    beams = stack.post("/v1/completions", ONE, completion(1, n=4, use_beam_search=True))
    assert refused(beams) == (400, "too_many_sequences", "n"), beams.text
    assert sim_received(stack.sim.url) - before == 0
    time.sleep(1.1)
    assert stack.post("/v1/chat/completions", ONE, CHAT).status_code == 200
    assert sim_received(stack.sim.url) - before == 1
    assert metric(stack.gateway.url, "gateway_requests_total", code="too_many_sequences") >= 3


def test_a_batch_of_3000_conversations_is_refused(stack: Stack) -> None:
    """A key without limits of its own: a batch over limits.max_sequences_per_request
    (256) is refused before the engine; n: 257 too; n: 256 and a small batch pass."""
    before = sim_received(stack.sim.url)
    batch = {"model": MODEL, "messages": [CHAT["messages"]] * 3000, "max_tokens": 1}
    resp = stack.post("/v1/chat/completions/batch", PLAIN, batch)
    assert refused(resp) == (400, "too_many_sequences", "messages"), resp.text
    assert "at most 256 in one request" in resp.json()["error"]["message"]
    over = stack.post("/v1/chat/completions", PLAIN, {**CHAT, "n": 257})
    assert refused(over) == (400, "too_many_sequences", "n")
    assert sim_received(stack.sim.url) - before == 0
    assert stack.post("/v1/chat/completions", PLAIN, {**CHAT, "n": 256}).status_code == 200
    # The simulator has no batch route (it answers 404): what matters is that it got there.
    small = {**batch, "messages": [CHAT["messages"]] * 3}
    stack.post("/v1/chat/completions/batch", PLAIN, small)
    assert sim_received(stack.sim.url) - before == 2


def test_the_in_flight_cap_counts_sequences(stack: Stack) -> None:
    """CAPPED (8 in flight) holds one streamed chat of n: 6: a chat of n: 3 is over the
    cap (429, nothing reaches the engine), one of n: 2 fits; once the stream ends, n: 8
    fits."""
    url = stack.gateway.url

    async def scenario() -> tuple[httpx.Response, float, httpx.Response]:
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as client,
            held_streams(client, 1, CAPPED, {**LONG, "n": 6}),
        ):
            before = sim_received(stack.sim.url)
            over = await client.post(
                "/v1/chat/completions", headers=auth(CAPPED), json={**CHAT, "n": 3}
            )
            delta = sim_received(stack.sim.url) - before
            fits = await client.post(
                "/v1/chat/completions", headers=auth(CAPPED), json={**CHAT, "n": 2}
            )
            return over, delta, fits

    refused_before = metric(url, "gateway_rate_limited_total", reason="in_flight")
    over, delta, fits = asyncio.run(scenario())
    assert refused(over) == (429, "rate_limited", None), over.text
    assert over.headers["retry-after"] == "1"
    assert "8 engine sequences in flight" in over.json()["error"]["message"]
    assert delta == 0
    assert fits.status_code == 200
    assert metric(url, "gateway_rate_limited_total", reason="in_flight") == refused_before + 1

    def whole_cap_fits() -> bool:
        return stack.post("/v1/chat/completions", CAPPED, {**CHAT, "n": KEY_CAP}).status_code == 200

    assert wait_for(whole_cap_fits, 10)
    nine = stack.post("/v1/chat/completions", CAPPED, {**CHAT, "n": KEY_CAP + 1})
    assert refused(nine) == (400, "too_many_sequences", "n")


def test_the_rate_counts_sequences(stack: Stack) -> None:
    """RATED: a burst of 8 tokens. Two completions of 4 prompts spend it; the next
    request, of any weight, is 429 and reaches no engine (8 HTTP requests passed when a
    request was one token)."""
    before = sim_received(stack.sim.url)
    burst = [stack.post("/v1/completions", RATED, completion(4)) for _ in range(2)]
    assert [r.status_code for r in burst] == [200, 200]
    over = stack.post("/v1/completions", RATED, completion(4))
    assert refused(over) == (429, "rate_limited", None), over.text
    single = stack.post("/v1/chat/completions", RATED, CHAT)
    assert refused(single) == (429, "rate_limited", None)
    assert sim_received(stack.sim.url) - before == 2
    # Another key is not held to RATED's bucket.
    assert stack.post("/v1/completions", PLAIN, completion(4)).status_code == 200
