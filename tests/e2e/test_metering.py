"""Metering through a running gateway and simulated engines, one answer shape at a time
(gateway/proxy/usage.py, gateway/proxy/metering.py): what each key is metered is what
the engine meant, whatever the client asked for and however the answer is shaped.
Each test uses its own key, so each reads its own counts."""

from __future__ import annotations

import io
import json
import socket
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    gateway_proc,
    leave_after,
    scrape,
    sim_proc,
    sim_received,
    total,
    wait_for,
)

SCRAPER = "sk-meter-scraper-0123456789-SECRET"
NAMES = (
    "messages",
    "decisions",
    "binary",
    "stored",
    "audio",
    "hidden",
    "early",
    "early-told",
    "early-messages",
    "early-responses",
    "responses",
    "lax",
    "refused",
    "scrub",
    "left-json",
    "stalled",
    "abandoned",
    "early-prompts",
)
KEYS = {name: f"sk-meter-{name}-0123456789-SECRET" for name in NAMES}


@dataclass
class Stack:
    sim: Proc
    gateway: Proc
    pooling: Proc
    pooling_gateway: Proc


def metric(gateway: Proc, name: str, **labels: str) -> float:
    return total(scrape(gateway.url + "/metrics", auth(SCRAPER)), name, **labels)


def tokens(gateway: Proc, key: str) -> tuple[float, float]:
    return (
        metric(gateway, "gateway_prompt_tokens_total", key=key),
        metric(gateway, "gateway_completion_tokens_total", key=key),
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("metering")
    # Calibrated: a long stream takes seconds, so a client can leave in the middle.
    sim = sim_proc(tmp, "--latency", "calibrated", "--enable-responses-api-store")
    pooling = sim_proc(tmp, "--runner", "pooling", "--latency", "zero")
    keys = [{"key": key, "name": name} for name, key in KEYS.items()]
    keys.append({"key": SCRAPER, "name": "scraper", "scopes": ["metrics"]})
    env = {"GATEWAY_API_KEYS": json.dumps(keys)}
    # A stream whose client left is read for a few more tokens only: the streams the
    # tests leave are still cut before their end.
    gateway = gateway_proc(
        tmp,
        {
            **env,
            "GATEWAY_ENGINES": json.dumps([sim.url]),
            "GATEWAY_TIMEOUTS__LEFT_GRACE": "0.05",
        },
    )
    pooling_gateway = gateway_proc(tmp, {**env, "GATEWAY_ENGINES": json.dumps([pooling.url])})
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


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A gateway before an engine that answers at once: a long answer is whole at the
    engine before the client has read much of it. A client that leaves its answer unread
    is dropped after a second."""
    tmp = tmp_path_factory.mktemp("metering-fast")
    sim = sim_proc(tmp, "--latency", "zero")
    keys = [{"key": key, "name": name} for name, key in KEYS.items()]
    keys.append({"key": SCRAPER, "name": "scraper", "scopes": ["metrics"]})
    env = {
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_TIMEOUTS__RESPONSE_STALL": "1",
        "GATEWAY_TIMEOUTS__LEFT_GRACE": "20",
    }
    gateway = gateway_proc(tmp, env)
    try:
        sim.start("/health")
        gateway.start("/healthz")
        assert wait_for(lambda: HTTP.get(gateway.url + "/readyz").status_code == 200)
        yield gateway
    finally:
        gateway.stop()
        sim.stop()


def unread(gateway: Proc, path: str, key: str, body: dict) -> socket.socket:
    """A connection that has sent `body` to `path` and has a small receive window: the
    gateway's buffers fill soon when it is not read."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gateway.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def sse_events(client: httpx.Client, path: str, key: str, body: dict) -> list[dict]:
    events = []
    with client.stream("POST", path, headers=auth(key), json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.mark.slow
def test_messages_are_metered_with_their_cached_prompt(stack: Stack) -> None:
    # vLLM's Anthropic `input_tokens` leaves out the cached prompt tokens
    # (`cache_read_input_tokens`): the prompt is all three counts.
    key = KEYS["messages"]
    system = "You answer in one line. " * 60
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "system": system,
        "messages": [{"role": "user", "content": "hello"}],
    }
    expected = [0, 0]
    with httpx.Client(base_url=stack.gateway.url, timeout=30) as client:
        for _ in range(2):
            r = client.post("/v1/messages", headers=auth(key), json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            expected[0] += usage["input_tokens"] + usage["cache_read_input_tokens"]
            expected[1] += usage["output_tokens"]
        assert usage["cache_read_input_tokens"] > usage["input_tokens"]
        events = sse_events(client, "/v1/messages", key, {**body, "stream": True})
    final = events[-2]
    assert final["type"] == "message_delta"
    expected[0] += final["usage"]["input_tokens"] + final["usage"]["cache_read_input_tokens"]
    expected[1] += final["usage"]["output_tokens"]
    assert wait_for(lambda: tokens(stack.gateway, "messages") == tuple(expected))


@pytest.mark.slow
def test_a_question_named_usage_does_not_hide_the_usage(stack: Stack) -> None:
    # /v1/systemone keys `answers` and `diagnostics` by the client's question ids, and
    # `diagnostics` comes after `usage`: the answer is parsed, not searched from its end.
    questions = {
        "ok": {"type": "noul"},
        "usage": {"type": "choice", "criteria": {"input_tokens": None, "prompt_tokens": None}},
    }
    body = {"model": MODEL, "state": "The door is open.", "questions": questions}
    r = HTTP.post(stack.gateway.url + "/v1/systemone", headers=auth(KEYS["decisions"]), json=body)
    assert r.status_code == 200, r.text
    assert r.content.rindex(b'"usage":') > r.content.index(b'"usage":')
    usage = r.json()["usage"]
    expected = (usage["input_tokens"], usage["output_tokens"])
    assert expected[0] > 0
    assert wait_for(lambda: tokens(stack.gateway, "decisions") == expected)


@pytest.mark.slow
def test_binary_embeddings_are_metered_from_their_metadata(stack: Stack) -> None:
    key = KEYS["binary"]
    url = stack.pooling_gateway.url + "/v1/embeddings"
    body = {"model": MODEL, "input": ["a b c d", "e f g"], "encoding_format": "bytes"}
    r = HTTP.post(url, headers=auth(key), json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    metered = json.loads(r.headers["metadata"])["usage"]["prompt_tokens"]
    assert metered > 0
    assert wait_for(lambda: tokens(stack.pooling_gateway, "binary") == (metered, 0))
    # `bytes_only` reports no usage anywhere: the gateway asks for `bytes`, and the client
    # gets what it asked for: the same vectors, no header.
    only = HTTP.post(url, headers=auth(key), json={**body, "encoding_format": "bytes_only"})
    assert only.status_code == 200, only.text
    assert "metadata" not in only.headers
    assert only.content == r.content
    assert wait_for(lambda: tokens(stack.pooling_gateway, "binary") == (2 * metered, 0))


@pytest.mark.slow
def test_a_stored_response_is_metered_once(stack: Stack) -> None:
    key = KEYS["stored"]
    body = {"model": MODEL, "input": "Say something.", "max_output_tokens": 6}
    r = HTTP.post(stack.gateway.url + "/v1/responses", headers=auth(key), json=body)
    assert r.status_code == 200, r.text
    made = r.json()
    expected = (made["usage"]["input_tokens"], made["usage"]["output_tokens"])
    assert wait_for(lambda: tokens(stack.gateway, "stored") == expected)
    for _ in range(3):
        read = HTTP.get(f"{stack.gateway.url}/v1/responses/{made['id']}", headers=auth(key))
        assert read.status_code == 200, read.text
        assert read.json()["usage"] == made["usage"]
    scraped = metric(stack.gateway, "gateway_requests_total", key="stored", status="200")
    assert scraped == 4
    assert tokens(stack.gateway, "stored") == expected


@pytest.mark.slow
def test_transcriptions_are_metered_in_seconds_of_audio(stack: Stack) -> None:
    key = KEYS["audio"]
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(16_000)
        w.writeframes(bytes(40_000))
    audio = out.getvalue()
    files = {"file": ("a.wav", audio, "audio/wav")}
    url = stack.gateway.url + "/v1/audio/transcriptions"
    seconds = 0
    for _ in range(2):
        r = HTTP.post(url, headers=auth(key), files=files, data={"model": MODEL}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["type"] == "duration"
        seconds += r.json()["usage"]["seconds"]
    assert seconds > 0
    assert wait_for(
        lambda: metric(stack.gateway, "gateway_audio_seconds_total", key="audio") == seconds
    )
    assert tokens(stack.gateway, "audio") == (0, 0)


@pytest.mark.slow
def test_a_stream_is_metered_whatever_the_client_asked(stack: Stack) -> None:
    # A client that leaves out `stream_options.include_usage` still gets metered, and
    # still gets no usage event: the gateway asks for it and takes it out.
    key = KEYS["hidden"]
    base = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to five"}],
        "max_tokens": 12,
        "stream": True,
    }
    with httpx.Client(base_url=stack.gateway.url, timeout=30) as client:
        told = sse_events(
            client,
            "/v1/chat/completions",
            key,
            {**base, "stream_options": {"include_usage": True}},
        )
        usage = told[-1]["usage"]
        assert wait_for(
            lambda: (
                tokens(stack.gateway, "hidden")
                == (usage["prompt_tokens"], usage["completion_tokens"])
            )
        )
        for body in (base, {**base, "stream_options": {"continuous_usage_stats": True}}):
            events = sse_events(client, "/v1/chat/completions", key, body)
            assert all(e.get("usage") is None for e in events)
            assert len(events) == len(told) - 1
            assert [e["choices"] for e in events] == [e["choices"] for e in told[:-1]]
        completions = sse_events(
            client, "/v1/completions", key, {**base, "messages": None, "prompt": "count to five"}
        )
        assert completions and all(e.get("usage") is None for e in completions)
    assert wait_for(
        lambda: (
            tokens(stack.gateway, "hidden")[0] > 3 * usage["prompt_tokens"]
            and tokens(stack.gateway, "hidden")[1] >= 3 * usage["completion_tokens"]
        )
    )


def prompt_tokens(gateway: Proc, path: str, body: dict) -> int:
    """The prompt tokens the engine counts for `body` (a short answer to the same)."""
    short = {**body, "max_tokens": 1, "stream": False, "ignore_eos": False}
    r = HTTP.post(gateway.url + path, headers=auth(KEYS["scrub"]), json=short)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "options"),
    [("early", None), ("early-told", {"include_usage": True})],
)
def test_a_client_that_leaves_early_is_metered_for_what_it_got(
    stack: Stack, name: str, options: dict | None
) -> None:
    # The gateway asks for every chunk's usage (`continuous_usage_stats`) and takes it
    # out of what the client gets: a client that leaves is metered the engine's last
    # counts, its whole prompt included.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on forever"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
        "stream_options": options,
    }
    prompt = prompt_tokens(stack.gateway, "/v1/chat/completions", body)
    got = 0
    with (
        httpx.Client(base_url=stack.gateway.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", headers=auth(KEYS[name]), json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert "usage" not in json.loads(line[len("data: ") :])
                got += 1
            if got == 20:
                break
    # Metered for the tokens generated (at least those this client read), not for 3,000.
    assert wait_for(lambda: tokens(stack.gateway, name)[1] >= 19, timeout=30)
    metered = tokens(stack.gateway, name)
    assert metered[0] == prompt > 0
    assert metered[1] < 3000
    left = metric(stack.gateway, "gateway_requests_total", key=name, code="client_disconnected")
    assert left == 1


@pytest.mark.slow
def test_a_client_that_leaves_a_stream_of_several_prompts_is_metered_every_prompt(
    stack: Stack,
) -> None:
    # vLLM runs every prompt of the list; a `messages` key beside it (a completion
    # ignores it) does not make it one prompt.
    body = {
        "model": MODEL,
        "prompt": [f"prompt {i} " + "lorem ipsum dolor sit amet " * 20 for i in range(4)],
        "messages": [],
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
    }
    prompt = prompt_tokens(stack.gateway, "/v1/completions", {**body, "messages": None})
    before = tokens(stack.gateway, "early-prompts")
    seen: set[int] = set()
    with (
        httpx.Client(base_url=stack.gateway.url, timeout=30) as client,
        client.stream(
            "POST", "/v1/completions", headers=auth(KEYS["early-prompts"]), json=body
        ) as r,
    ):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[len("data: ") :])["choices"])
            if len(seen) == 4:
                # Every prompt has begun; the client leaves long before 4 x 60 tokens.
                break
    assert wait_for(lambda: tokens(stack.gateway, "early-prompts")[0] > before[0], timeout=30)
    metered = tokens(stack.gateway, "early-prompts")
    # Each prompt once: four prompts, not the last chunk's one.
    assert metered[0] - before[0] == prompt


@pytest.mark.slow
def test_a_client_that_leaves_a_messages_stream_is_metered_its_prompt(stack: Stack) -> None:
    # vLLM reports a /v1/messages stream's usage in `message_delta`, at its end; its
    # `message_start` carries the prompt's count and each `content_block_delta` one
    # output: a client that leaves before the end is metered those.
    body = {
        "model": MODEL,
        "max_tokens": 3000,
        "messages": [{"role": "user", "content": "tell me about the river"}],
    }
    # The whole answer's length (Anthropic's API has no `ignore_eos`).
    whole = HTTP.post(stack.gateway.url + "/v1/messages", headers=auth(KEYS["scrub"]), json=body)
    assert whole.status_code == 200, whole.text
    length = whole.json()["usage"]["output_tokens"]
    assert length > 10
    events = leave_after(
        stack.gateway.url, "/v1/messages", KEYS["early-messages"], {**body, "stream": True}, 5
    )
    assert events[0]["type"] == "message_start"
    prompt = events[0]["message"]["usage"]["input_tokens"]
    assert prompt > 0
    assert all(e["type"] != "message_delta" for e in events)
    assert wait_for(lambda: tokens(stack.gateway, "early-messages")[1] >= 5, timeout=30)
    metered = tokens(stack.gateway, "early-messages")
    assert metered[0] == prompt
    assert metered[1] < length
    left = metric(
        stack.gateway, "gateway_requests_total", key="early-messages", code="client_disconnected"
    )
    assert left == 1


@pytest.mark.slow
def test_a_client_that_leaves_a_responses_stream_is_metered_its_output(stack: Stack) -> None:
    # A /v1/responses stream reports no count before `response.completed`, its last
    # event: a client that leaves before it is metered one token an output event.
    body = {
        "model": MODEL,
        "max_output_tokens": 3000,
        "input": "go on forever about the river",
        "ignore_eos": True,
        "stream": True,
        "store": False,
    }
    events = leave_after(stack.gateway.url, "/v1/responses", KEYS["early-responses"], body, 20)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["usage"] is None
    assert wait_for(lambda: tokens(stack.gateway, "early-responses")[1] >= 20, timeout=30)
    metered = tokens(stack.gateway, "early-responses")
    assert metered[0] == 0
    assert metered[1] < 3000
    left = metric(
        stack.gateway, "gateway_requests_total", key="early-responses", code="client_disconnected"
    )
    assert left == 1


@pytest.mark.slow
def test_a_whole_responses_stream_is_metered_its_usage(stack: Stack) -> None:
    body = {"model": MODEL, "max_output_tokens": 9, "input": "count to five", "stream": True}
    with httpx.Client(base_url=stack.gateway.url, timeout=30) as client:
        events = sse_events(client, "/v1/responses", KEYS["responses"], body)
    assert sum(e["type"] == "response.output_text.delta" for e in events) == 9
    usage = events[-1]["response"]["usage"]
    expected = (usage["input_tokens"], usage["output_tokens"])
    assert expected[0] > 0
    assert wait_for(lambda: tokens(stack.gateway, "responses") == expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "base"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count to five"}]}),
        ("/v1/completions", {"prompt": "count to five"}),
    ],
)
def test_a_stream_asked_with_lax_booleans_is_metered(
    stack: Stack, path: str, base: dict[str, object]
) -> None:
    # vLLM's pydantic reads "true", 1 and "yes" as true and "false", 0 and "off" as
    # false: each of these streams, and each is metered.
    key = KEYS["lax"]
    base = {**base, "model": MODEL, "max_tokens": 12}
    before = tokens(stack.gateway, "lax")
    with httpx.Client(base_url=stack.gateway.url, timeout=30) as client:
        told = sse_events(
            client, path, key, {**base, "stream": True, "stream_options": {"include_usage": True}}
        )
        usage = told[-1]["usage"]
        unasked = [
            {"stream": "true"},
            {"stream": 1, "stream_options": {"include_usage": "false"}},
            {"stream": "ON", "stream_options": {"include_usage": 0, "continuous_usage_stats": 1}},
        ]
        for body in unasked:
            events = sse_events(client, path, key, {**base, **body})
            assert len(events) == len(told) - 1 > 1, body
            assert all("usage" not in e for e in events), body
        # Asked with "yes": the usage event, and no chunk's usage.
        asked = {"stream": "yes", "stream_options": {"include_usage": "t"}}
        events = sse_events(client, path, key, {**base, **asked})
        assert events[-1]["usage"] == usage
        assert all("usage" not in e for e in events[:-1])
    runs = len(unasked) + 2
    expected = (
        before[0] + runs * usage["prompt_tokens"],
        before[1] + runs * usage["completion_tokens"],
    )
    assert wait_for(lambda: tokens(stack.gateway, "lax") == expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": "maybe"}, "stream"),
        ({"stream": 2}, "stream"),
        (
            {"stream": "true", "stream_options": {"include_usage": "sure"}},
            "stream_options.include_usage",
        ),
        ({"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
    ],
)
def test_a_stream_option_vllm_cannot_read_is_refused(
    stack: Stack, body: dict[str, object], param: str
) -> None:
    sent = sim_received(stack.sim.url)
    full = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **body}
    r = HTTP.post(stack.gateway.url + "/v1/completions", headers=auth(KEYS["refused"]), json=full)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_request", param)
    assert sim_received(stack.sim.url) == sent


@pytest.mark.slow
def test_a_question_id_that_would_push_the_answer_past_its_parse_is_refused(
    stack: Stack,
) -> None:
    # The id is echoed in `answers` and `diagnostics`: 2.2 MB of it made a 4.4 MB answer,
    # over the 4 MiB the gateway parses for the usage, and nothing was metered.
    sent = sim_received(stack.sim.url)
    body = {"model": MODEL, "state": "s", "questions": {"q" * 2_200_000: {"type": "noul"}}}
    url = stack.gateway.url + "/v1/systemone"
    r = HTTP.post(url, headers=auth(KEYS["refused"]), json=body, timeout=30)
    assert r.status_code == 400, r.text[:200]
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
        "invalid_request",
        "questions",
    )
    assert sim_received(stack.sim.url) == sent
    # A long id under the bound is answered and metered.
    body["questions"] = {"q" * 100_000: {"type": "noul"}}
    r = HTTP.post(url, headers=auth(KEYS["refused"]), json=body, timeout=30)
    assert r.status_code == 200, r.text[:200]
    usage = r.json()["usage"]
    assert wait_for(
        lambda: tokens(stack.gateway, "refused") == (usage["input_tokens"], usage["output_tokens"])
    )


@pytest.mark.slow
def test_an_engine_error_keeps_its_numbers(stack: Stack) -> None:
    # vLLM lists out-of-vocabulary ids in brackets: `[99999999]` is no IPv6 address.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {"99999999": 5},
    }
    r = HTTP.post(
        stack.gateway.url + "/v1/chat/completions", headers=auth(KEYS["scrub"]), json=body
    )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "token_id(s) [99999999] in logit_bias" in message
    assert "<address>" not in message


@pytest.mark.slow
def test_a_client_that_leaves_a_long_json_answer_is_metered_its_usage(fast: Proc) -> None:
    # A JSON answer over 64 KiB is relayed as it comes, its usage near its end; the
    # engine made it whole before sending it. A client that leaves after its first bytes
    # is metered the usage the gateway reads in the rest (not relayed).
    body = {
        "model": MODEL,
        "prompt": [f"tell story {i} at length" for i in range(64)],
        "max_tokens": 30000,
        "ignore_eos": True,
    }
    prompt = prompt_tokens(fast, "/v1/completions", body)
    with unread(fast, "/v1/completions", KEYS["left-json"], body) as sock:
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(1024)
        assert got.startswith(b"HTTP/1.1 200")
        # 7.7 MB of text: the answer's usage has not reached the client.
        assert b'"usage"' not in got
    assert wait_for(lambda: tokens(fast, "left-json")[1] > 0, timeout=30)
    assert tokens(fast, "left-json") == (prompt, 64 * 30000)
    left = metric(fast, "gateway_requests_total", key="left-json", code="client_disconnected")
    assert left == 1


@pytest.mark.slow
def test_a_client_dropped_for_not_reading_a_stream_is_metered_what_was_made(fast: Proc) -> None:
    # The engine goes on while the client does not read; the gateway drops the client
    # (timeouts.response_stall) and reads what the engine sent meanwhile, for up to
    # timeouts.left_grace, unrelayed: the chunks' counts are the engine's latest.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on forever"}],
        "max_tokens": 30000,
        "ignore_eos": True,
        "stream": True,
    }
    prompt = prompt_tokens(fast, "/v1/chat/completions", body)
    with unread(fast, "/v1/chat/completions", KEYS["stalled"], body) as sock:
        dropped = lambda: (  # noqa: E731
            metric(fast, "gateway_requests_total", key="stalled", code="client_disconnected") == 1
        )
        assert wait_for(dropped, timeout=60)
        # 30,000 chunks of ~300 bytes: far more than the buffers between engine and client.
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        assert b"[DONE]" not in got
    assert wait_for(lambda: tokens(fast, "stalled")[1] > 0, timeout=30)
    assert tokens(fast, "stalled") == (prompt, 30000)


@pytest.mark.slow
def test_a_client_that_leaves_before_a_json_answer_starts_is_metered_it(stack: Stack) -> None:
    # A non-streamed answer starts once the engine has made it whole: a client that
    # leaves while it is made does not stop the engine's request, whose answer the
    # gateway reads (not relayed) and meters.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell a long story"}],
        "max_tokens": 300,
        "ignore_eos": True,
    }
    prompt = prompt_tokens(stack.gateway, "/v1/chat/completions", body)
    with unread(stack.gateway, "/v1/chat/completions", KEYS["abandoned"], body):
        # 300 simulated decode steps take 2.4 s; the client leaves well before.
        time.sleep(0.5)
    assert wait_for(lambda: tokens(stack.gateway, "abandoned")[1] > 0, timeout=30)
    assert tokens(stack.gateway, "abandoned") == (prompt, 300)
    left = metric(
        stack.gateway, "gateway_requests_total", key="abandoned", code="client_disconnected"
    )
    assert left == 1
