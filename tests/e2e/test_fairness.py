"""Per-key fairness through the gateway under uvicorn, in front of a simulated engine.

- Slow uploads hold no global slot: one key holding `max_in_flight` uploads that sent
  their headers and one byte of body does not lock another key out.
- A key's requests in flight are capped from authentication on, slow uploads included.
- A key's token bucket: the burst passes, then 429 with a Retry-After that is enough.
Every refusal: status, code, Retry-After, and nothing reached the engine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass

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
)

UPSTREAM = "upstream-fairness-0123456789"
A = "sk-fair-a-0123456789abcdef"
B = "sk-fair-b-0123456789abcdef"
CAPPED = "sk-fair-capped-0123456789abcdef"
RATED = "sk-fair-rated-0123456789abcdef"
MAX_IN_FLIGHT = 8
KEY_CAP = 3
# RATED's token bucket: a token every 4 s, so three requests sent one after the other
# find the burst spent however loaded the machine is.
RATE = 0.25
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# A generation that streams for a long while: it holds its slots until closed.
LONG = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}


@dataclass
class Stack:
    sim: Proc
    plain: Proc  # keys A and B as plain strings: settings that predate per-key limits
    limited: Proc  # CAPPED (its own in-flight cap) and RATED (its own token bucket)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fairness")
    sim = sim_proc(tmp, "--api-key", UPSTREAM)
    base = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_UPSTREAM_API_KEY": UPSTREAM,
        "GATEWAY_LIMITS__MAX_IN_FLIGHT": str(MAX_IN_FLIGHT),
        "GATEWAY_PUBLIC_METRICS": "true",
    }
    plain = gateway_proc(tmp, {**base, "GATEWAY_API_KEYS": json.dumps([A, B])})
    keys = [
        {"key": A, "name": "a"},
        {"key": CAPPED, "name": "capped", "max_in_flight": KEY_CAP},
        {"key": RATED, "name": "rated", "rate": {"requests_per_second": RATE, "burst": 2}},
    ]
    limited = gateway_proc(tmp, {**base, "GATEWAY_API_KEYS": json.dumps(keys)})
    with running(sim):
        for gw in (plain, limited):
            gw.start("/healthz")
        try:
            for gw in (plain, limited):
                assert _wait_ready(gw)
            yield Stack(sim, plain, limited)
        finally:
            for gw in (plain, limited):
                gw.stop()


def _until_refused(url: str, key: str) -> bool:
    """Whether a GET of `url` with `key` is answered 429 within 20 s."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if HTTP.get(url, headers=auth(key)).status_code == 429:
            return True
        time.sleep(0.05)
    return False


def _wait_ready(gw: Proc) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if HTTP.get(gw.url + "/readyz").status_code == 200:
            return True
        time.sleep(0.1)
    return False


BODY = json.dumps(CHAT).encode()


def slow_upload(gw: Proc, key: str) -> socket.socket:
    """A chat request whose headers and first body byte are sent, the rest withheld."""
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    )
    sock.sendall(head.encode() + BODY[:1])
    return sock


def finish_upload(sock: socket.socket) -> bytes:
    """Send the rest of CHAT and read the answer's status line."""
    sock.sendall(BODY[1:])
    return sock.recv(65536).split(b"\r\n", 1)[0]


@pytest.mark.slow
def test_slow_uploads_of_one_key_do_not_lock_another_out(stack: Stack) -> None:
    """Key A holds max_in_flight uploads that sent headers and one byte; key B is
    served, and A's uploads, once finished, are served too."""
    before = sim_received(stack.sim.url)
    with ExitStack() as held:
        socks = [held.enter_context(closing(slow_upload(stack.plain, A))) for _ in range(8)]
        time.sleep(0.5)  # the gateway has taken them all in
        # With the uploads holding global slots, B would be refused: 503 overloaded.
        resp = HTTP.post(stack.plain.url + "/v1/chat/completions", json=CHAT, headers=auth(B))
        assert (resp.status_code, error_code(resp)) == (200, None), resp.text
        # The uploads were still open and unanswered: nothing of them reached the engine.
        assert sim_received(stack.sim.url) - before == 1
        for sock in socks:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
            sock.setblocking(True)
        assert [finish_upload(s) for s in socks[:2]] == [b"HTTP/1.1 200 OK"] * 2
    assert metric(stack.plain.url, "gateway_requests_total", code="overloaded") == 0


@pytest.mark.slow
def test_slow_uploads_count_against_the_keys_cap(stack: Stack) -> None:
    """The per-key count starts at authentication: a key holding its cap in slow
    uploads gets 429 for the next request, which never reaches the engine."""
    before = sim_received(stack.sim.url)
    with ExitStack() as held:
        socks = [
            held.enter_context(closing(slow_upload(stack.limited, CAPPED))) for _ in range(KEY_CAP)
        ]
        # Once the gateway has read their heads, the uploads hold the key's cap: its
        # /v1/models, answered by the gateway, is refused (it never is if they do not).
        assert _until_refused(stack.limited.url + "/v1/models", CAPPED)
        over = HTTP.post(
            stack.limited.url + "/v1/chat/completions", json=CHAT, headers=auth(CAPPED)
        )
        assert (over.status_code, error_code(over)) == (429, "rate_limited")
        assert over.headers["retry-after"] == "1"
        other = HTTP.post(stack.limited.url + "/v1/chat/completions", json=CHAT, headers=auth(A))
        assert other.status_code == 200
        assert sim_received(stack.sim.url) - before == 1
        # A finished upload gives its slot back.
        assert finish_upload(socks[0]) == b"HTTP/1.1 200 OK"
    ok = HTTP.post(stack.limited.url + "/v1/chat/completions", json=CHAT, headers=auth(CAPPED))
    assert ok.status_code == 200


@pytest.mark.slow
def test_key_cap_on_requests_in_flight(stack: Stack) -> None:
    """CAPPED holds KEY_CAP long generations: its next request gets 429 rate_limited
    with Retry-After and reaches no engine, while key A is served."""
    url = stack.limited.url

    async def scenario() -> tuple[httpx.Response, httpx.Response, float]:
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as client,
            held_streams(client, KEY_CAP, CAPPED, LONG),
        ):
            before = sim_received(stack.sim.url)
            over = await client.post("/v1/chat/completions", headers=auth(CAPPED), json=CHAT)
            delta = sim_received(stack.sim.url) - before
            other = await client.post("/v1/chat/completions", headers=auth(A), json=CHAT)
            return over, other, delta

    refused_before = metric(url, "gateway_rate_limited_total", reason="in_flight")
    over, other, delta = asyncio.run(scenario())
    assert (over.status_code, error_code(over)) == (429, "rate_limited")
    assert over.headers["retry-after"] == "1"
    assert delta == 0
    assert other.status_code == 200
    assert metric(url, "gateway_rate_limited_total", reason="in_flight") == refused_before + 1
    # The slots come back when the streams end.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ok = HTTP.post(url + "/v1/chat/completions", json=CHAT, headers=auth(CAPPED))
        if ok.status_code == 200:
            break
        time.sleep(0.1)
    assert ok.status_code == 200


@pytest.mark.slow
def test_rate_limit_burst_then_retry_after(stack: Stack) -> None:
    """RATED: a token every 4 s, a burst of 2. Two pass, the third gets 429 with
    Retry-After of at most 4 s; after waiting that long, one passes again. The engine saw
    only the admitted ones."""
    url = stack.limited.url + "/v1/chat/completions"
    before = sim_received(stack.sim.url)
    burst = [HTTP.post(url, json=CHAT, headers=auth(RATED)) for _ in range(2)]
    over = HTTP.post(url, json=CHAT, headers=auth(RATED))
    assert [r.status_code for r in burst] == [200, 200]
    assert (over.status_code, error_code(over)) == (429, "rate_limited")
    retry = int(over.headers["retry-after"])
    assert 1 <= retry <= 1 / RATE
    # Another key is not held to RATED's bucket.
    assert HTTP.post(url, json=CHAT, headers=auth(A)).status_code == 200
    assert sim_received(stack.sim.url) - before == 3
    time.sleep(retry + 0.1)
    again = HTTP.post(url, json=CHAT, headers=auth(RATED))
    assert again.status_code == 200
    assert sim_received(stack.sim.url) - before == 4
    assert metric(stack.limited.url, "gateway_rate_limited_total", reason="rate") >= 1


@pytest.mark.slow
def test_rate_limited_body_is_not_read(stack: Stack) -> None:
    """A refused request is answered before its body: a key over its rate gets 429
    even for a body it never finishes sending."""
    url = stack.limited.url + "/v1/chat/completions"
    while HTTP.post(url, json=CHAT, headers=auth(RATED)).status_code == 200:
        pass
    with closing(slow_upload(stack.limited, RATED)) as sock:
        sock.settimeout(5)
        status = sock.recv(65536).split(b"\r\n", 1)[0]
    assert status == b"HTTP/1.1 429 Too Many Requests"
