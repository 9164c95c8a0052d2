"""Metering against the real engine: what the gateway meters each key is what vLLM itself
counted (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`), answer shape by
answer shape (gateway/proxy/usage.py, gateway/proxy/metering.py; docs/gateway.md,
"Metering").

The `metering` engine is a tiny Qwen3 (/v1/systemone serves Qwen3 and five other
architectures only) run with `--enable-prompt-tokens-details` (every usage object splits
off the cached prompt) and the Responses store on; binary embeddings go to the embedding
engine. Both run for this module only. Each test meters its own key."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc, auth, error_code, leave_after, scrape, total, wait_for
from tests.real.conftest import Engines
from tests.real.harness import Snapshot, gateway, received

pytestmark = pytest.mark.real_vllm

SCRAPER = "sk-real-meter-scraper-0123456789"
NAMES = (
    "messages",
    "hidden",
    "early",
    "early-messages",
    "early-responses",
    "refused",
    "binary",
    "stored",
    "decisions",
    "scrub",
    "left-json",
)
KEYS = {name: f"sk-real-meter-{name}-0123456789" for name in NAMES}
SECRET = "real-tier-namespace-secret-0123456789"
OTHER_SECRET = "another-namespace-secret-0123456789"
# Seconds for one answer: a busy 2-core machine shares the engine with other work.
TIMEOUT = 60


@dataclass
class Stack:
    engine: Engine
    embed: Engine
    # Two gateways sharing a namespace secret, and one with another secret.
    gateway: Proc
    twin: Proc
    stranger: Proc
    embed_gateway: Proc


def _env(secret: str) -> dict[str, str]:
    keys = [{"key": key, "name": name} for name, key in KEYS.items()]
    keys.append({"key": SCRAPER, "name": "scraper", "scopes": ["metrics"]})
    return {
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": secret,
        # A stream whose client left is read for a few more outputs only: the streams
        # the tests leave are still cut before their end.
        "GATEWAY_TIMEOUTS__LEFT_GRACE": "0.05",
    }


@pytest.fixture(scope="module")
def stack(real_engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    real_engines.warm("metering", "embed")
    engine, embed = real_engines.get("metering"), real_engines.get("embed")
    tmp: Path = tmp_path_factory.mktemp("metering")
    try:
        with (
            gateway(tmp, [engine], **_env(SECRET)) as gw,
            gateway(tmp, [engine], **_env(SECRET)) as twin,
            gateway(tmp, [engine], **_env(OTHER_SECRET)) as stranger,
            gateway(tmp, [embed], **_env(SECRET)) as embed_gw,
        ):
            yield Stack(engine, embed, gw, twin, stranger, embed_gw)
    finally:
        real_engines.stop("metering", "embed")


def metered(gw: Proc, name: str) -> tuple[float, float]:
    """(prompt, completion) tokens the gateway metered for key `name`."""
    samples = scrape(gw.url + "/metrics", auth(SCRAPER))
    return (
        total(samples, "gateway_prompt_tokens_total", key=name),
        total(samples, "gateway_completion_tokens_total", key=name),
    )


def counted(engine: Engine, since: Snapshot) -> tuple[float, float]:
    """(prompt, generated) tokens the engine counted since `since`."""
    now = Snapshot.of(engine)
    return now.prompt_tokens - since.prompt_tokens, now.generated - since.generated


def metered_as_counted(
    gw: Proc, name: str, engine: Engine, call: Callable[[], object]
) -> tuple[float, float]:
    """Run `call` and check that it moved key `name`'s metered tokens by what it moved
    the engine's own counters (both read once they settle); returns that move."""
    before_key, before_engine = metered(gw, name), Snapshot.of(engine)

    def moved() -> tuple[tuple[float, float], tuple[float, float]]:
        now = metered(gw, name)
        key = (now[0] - before_key[0], now[1] - before_key[1])
        return key, counted(engine, before_engine)

    call()
    last: list[tuple[float, float]] = []

    def settled() -> bool:
        last[:] = moved()
        return last[1][0] > 0 and last[0] == last[1]

    assert wait_for(settled, timeout=15), f"metered {last[0]}, the engine counted {last[1]}"
    return last[0]


def sse_events(url: str, key: str, body: dict[str, object]) -> list[dict[str, object]]:
    events = []
    with HTTP.stream("POST", url, headers=auth(key), json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_messages_are_metered_at_the_engines_prompt_count(stack: Stack) -> None:
    # With --enable-prompt-tokens-details vLLM's Anthropic `input_tokens` leaves out the
    # cached and newly cached prompt: a ~860-token prompt answers `input_tokens` ~90.
    url = stack.gateway.url + "/v1/messages"
    body = {
        "model": stack.engine.name,
        "max_tokens": 5,
        "system": "You answer in one line about the red car on the road. " * 60,
        "messages": [{"role": "user", "content": "hello"}],
    }
    answers: list[dict[str, int]] = []

    def ask() -> None:
        r = HTTP.post(url, headers=auth(KEYS["messages"]), json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        answers.append(r.json()["usage"])

    first = metered_as_counted(stack.gateway, "messages", stack.engine, ask)
    assert answers[-1]["cache_creation_input_tokens"] > answers[-1]["input_tokens"]
    # The same prompt again: a prefix cache hit.
    again = metered_as_counted(stack.gateway, "messages", stack.engine, ask)
    assert answers[-1]["cache_read_input_tokens"] > answers[-1]["input_tokens"]
    assert again[0] == first[0]

    def stream() -> None:
        events = sse_events(url, KEYS["messages"], {**body, "stream": True})
        delta = [e for e in events if e["type"] == "message_delta"][-1]
        answers.append(delta["usage"])  # type: ignore[arg-type]

    streamed = metered_as_counted(stack.gateway, "messages", stack.engine, stream)
    assert answers[-1]["cache_read_input_tokens"] > answers[-1]["input_tokens"]
    assert streamed == first


def _stream_body(stack: Stack, path: str, **fields: object) -> dict[str, object]:
    body: dict[str, object] = {"model": stack.engine.name, **fields}
    if path == "/v1/completions":
        body["prompt"] = "Tell me about the city by the river."
    else:
        body["messages"] = [{"role": "user", "content": "Tell me about the city by the river."}]
    return body


@pytest.mark.parametrize(
    ("path", "stream", "options"),
    [
        ("/v1/chat/completions", True, None),
        ("/v1/chat/completions", True, {"continuous_usage_stats": True}),
        ("/v1/completions", True, None),
        # vLLM's pydantic reads these as a stream without usage: each is metered.
        ("/v1/chat/completions", "true", None),
        ("/v1/completions", 1, {"include_usage": "false"}),
        ("/v1/chat/completions", "yes", {"include_usage": "off", "continuous_usage_stats": "on"}),
    ],
)
def test_a_stream_without_include_usage_is_metered(
    stack: Stack, path: str, stream: object, options: dict[str, object] | None
) -> None:
    # vLLM reports a stream's usage only when asked (`stream_options.include_usage`): the
    # gateway asks, meters the event and takes it out, and takes out each chunk's usage.
    body = _stream_body(stack, path, max_tokens=7, ignore_eos=True, stream=stream)
    if options is not None:
        body["stream_options"] = options
    seen: list[dict[str, object]] = []
    moved = metered_as_counted(
        stack.gateway,
        "hidden",
        stack.engine,
        lambda: seen.extend(sse_events(stack.gateway.url + path, KEYS["hidden"], body)),
    )
    assert moved[1] == 7
    assert len(seen) > 1
    assert all("usage" not in e or e["usage"] is None for e in seen)
    assert seen[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


@pytest.mark.parametrize(
    ("stream", "options", "param"),
    [
        ("maybe", None, "stream"),
        (2, None, "stream"),
        ("true", {"include_usage": "sure"}, "stream_options.include_usage"),
    ],
)
def test_a_stream_flag_vllm_cannot_read_is_refused(
    stack: Stack, stream: object, options: dict[str, object] | None, param: str
) -> None:
    body = _stream_body(stack, "/v1/completions", max_tokens=3, stream=stream)
    if options is not None:
        body["stream_options"] = options
    # vLLM refuses it too.
    direct = HTTP.post(stack.engine.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert direct.status_code == 400
    before = Snapshot.of(stack.engine)
    r = HTTP.post(
        stack.gateway.url + "/v1/completions",
        headers=auth(KEYS["refused"]),
        json=body,
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    assert (error_code(r), r.json()["error"]["param"]) == ("invalid_request", param)
    assert Snapshot.of(stack.engine) == before


def test_a_client_that_leaves_a_stream_is_metered_its_prompt(stack: Stack) -> None:
    # The gateway asks for every chunk's usage (`continuous_usage_stats`): a client that
    # leaves is metered the prompt as the engine counted it, and at most what the engine
    # generated before it aborted.
    path = "/v1/chat/completions"
    body = _stream_body(stack, path, max_tokens=400, ignore_eos=True, stream=True)
    before_key, before_engine = metered(stack.gateway, "early"), Snapshot.of(stack.engine)
    got = 0
    with HTTP.stream(
        "POST", stack.gateway.url + path, headers=auth(KEYS["early"]), json=body, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert "usage" not in json.loads(line[len("data: ") :])
                got += 1
            if got == 6:
                break
    last: list[tuple[float, float]] = []

    def settled() -> bool:
        now = metered(stack.gateway, "early")
        key = (now[0] - before_key[0], now[1] - before_key[1])
        engine = counted(stack.engine, before_engine)
        last[:] = [key, engine]
        return key[1] >= 5 and engine[0] > 0 and Snapshot.of(stack.engine).running == 0

    assert wait_for(settled, timeout=30), f"metered {last[0]}, the engine counted {last[1]}"
    key, engine = last
    assert key[0] == engine[0]
    assert 5 <= key[1] <= engine[1] < 400


def left_early(
    stack: Stack, name: str, since: tuple[tuple[float, float], Snapshot]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(metered, counted by the engine) for key `name` once the engine aborted."""
    before_key, before_engine = since
    last: list[tuple[float, float]] = []

    def settled() -> bool:
        now = metered(stack.gateway, name)
        key = (now[0] - before_key[0], now[1] - before_key[1])
        engine = counted(stack.engine, before_engine)
        last[:] = [key, engine]
        return key[1] >= 6 and engine[0] > 0 and Snapshot.of(stack.engine).running == 0

    assert wait_for(settled, timeout=30), f"metered {last}"
    return last[0], last[1]


def test_a_client_that_leaves_a_messages_stream_is_metered_its_prompt(stack: Stack) -> None:
    # vLLM reports a /v1/messages stream's usage in `message_delta`, at its end; its
    # `message_start` carries the prompt's count, each `content_block_delta` one engine
    # output (one token or more).
    body = {
        "model": stack.engine.name,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "Tell me about the city by the river."}],
        "stream": True,
    }
    since = metered(stack.gateway, "early-messages"), Snapshot.of(stack.engine)
    events = leave_after(
        stack.gateway.url, "/v1/messages", KEYS["early-messages"], body, 6, TIMEOUT
    )
    assert all(e["type"] != "message_delta" for e in events)
    key, engine = left_early(stack, "early-messages", since)
    start = events[0]
    assert start["type"] == "message_start"
    assert key[0] == engine[0] == start["message"]["usage"]["input_tokens"]
    assert 6 <= key[1] <= engine[1] < 400


def test_a_client_that_leaves_a_responses_stream_is_metered_its_output(stack: Stack) -> None:
    # A /v1/responses stream reports no count before `response.completed`, its last
    # event: what the engine generated before it aborted is metered one token an output
    # event, and the prompt not at all.
    body = {
        "model": stack.engine.name,
        "max_output_tokens": 400,
        "ignore_eos": True,
        "input": "Tell me about the city by the river.",
        "stream": True,
        "store": False,
    }
    since = metered(stack.gateway, "early-responses"), Snapshot.of(stack.engine)
    events = leave_after(
        stack.gateway.url, "/v1/responses", KEYS["early-responses"], body, 6, TIMEOUT
    )
    assert events[0]["response"]["usage"] is None
    assert all(e["type"] != "response.completed" for e in events)
    key, engine = left_early(stack, "early-responses", since)
    assert key[0] == 0 < engine[0]
    assert 6 <= key[1] <= engine[1] < 400


def test_a_client_that_leaves_a_long_json_answer_is_metered_its_usage(stack: Stack) -> None:
    # vLLM makes a non-streamed answer whole before sending it; one over 64 KiB is
    # relayed as it comes, its usage after the choices' logprobs. A client that leaves
    # after the first choice's text is metered what the engine counted: the gateway
    # reads the rest of the answer, not relayed, for its usage.
    body = {
        "model": stack.engine.name,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "n": 4,
        "logprobs": True,
        "top_logprobs": 20,
    }
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: Bearer {KEYS['left-json']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()

    def leave() -> None:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(TIMEOUT)
            sock.connect(("127.0.0.1", stack.gateway.port))
            sock.sendall(head + data)
            got = b""
            while b'"logprobs":{' not in got:
                chunk = sock.recv(65536)
                assert chunk, got[:300]
                got += chunk
            assert got.startswith(b"HTTP/1.1 200")
            assert b'"usage"' not in got

    before_key, before_engine = metered(stack.gateway, "left-json"), Snapshot.of(stack.engine)
    leave()
    last: list[tuple[float, float]] = []

    def settled() -> bool:
        now = metered(stack.gateway, "left-json")
        last[:] = [(now[0] - before_key[0], now[1] - before_key[1])]
        last.append(counted(stack.engine, before_engine))
        return last[0][1] > 0 and Snapshot.of(stack.engine).running == 0

    assert wait_for(settled, timeout=30), f"metered {last}"
    key, engine = last
    # vLLM's prompt counter counts the prompt once a choice (n = 4); `usage` once.
    assert (key[0] * 4, key[1]) == engine == (engine[0], 4 * 1000)


def test_binary_embeddings_are_metered(stack: Stack) -> None:
    url = stack.embed_gateway.url + "/v1/embeddings"
    body = {
        "model": stack.embed.name,
        "input": ["the red car on the road", "a bird in the tree"],
        "encoding_format": "bytes",
    }
    answers: list[httpx.Response] = []

    def ask(fmt: str) -> Callable[[], None]:
        def call() -> None:
            r = HTTP.post(
                url,
                headers=auth(KEYS["binary"]),
                json={**body, "encoding_format": fmt},
                timeout=TIMEOUT,
            )
            assert r.status_code == 200, r.text
            answers.append(r)

        return call

    moved = metered_as_counted(stack.embed_gateway, "binary", stack.embed, ask("bytes"))
    header = json.loads(answers[-1].headers["metadata"])
    assert moved == (header["usage"]["prompt_tokens"], 0)
    # `bytes_only` reports usage nowhere: metered all the same, and answered as vLLM
    # answers it.
    assert (
        metered_as_counted(stack.embed_gateway, "binary", stack.embed, ask("bytes_only")) == moved
    )
    direct = HTTP.post(
        stack.embed.url + "/v1/embeddings",
        json={**body, "encoding_format": "bytes_only"},
        timeout=TIMEOUT,
    )
    assert direct.status_code == 200
    assert "metadata" not in direct.headers and "metadata" not in answers[-1].headers
    assert answers[-1].headers["content-type"] == direct.headers["content-type"]
    assert answers[-1].content == direct.content == answers[0].content


def test_a_stored_response_is_metered_once_and_read_by_a_twin_gateway(stack: Stack) -> None:
    key = KEYS["stored"]
    body = {
        "model": stack.engine.name,
        "input": "Say something about the sea.",
        "max_output_tokens": 6,
        "store": True,
    }
    made: list[dict[str, object]] = []

    def create() -> None:
        r = HTTP.post(
            stack.gateway.url + "/v1/responses", headers=auth(key), json=body, timeout=TIMEOUT
        )
        assert r.status_code == 200, r.text
        made.append(r.json())

    moved = metered_as_counted(stack.gateway, "stored", stack.engine, create)
    answer = made[0]
    assert (answer["usage"]["input_tokens"], answer["usage"]["output_tokens"]) == moved  # type: ignore[index]
    before = Snapshot.of(stack.engine)
    # Read back through the gateway that made it, and through another process with the
    # same namespace secret: the engine's stored answer, metered to nobody.
    for gw in (stack.gateway, stack.gateway, stack.twin):
        read = HTTP.get(f"{gw.url}/v1/responses/{answer['id']}", headers=auth(key), timeout=TIMEOUT)
        assert read.status_code == 200, read.text
        assert read.json() == answer
    assert len(received(stack.engine)) == before.requests + 3
    assert counted(stack.engine, before) == (0, 0)
    served = {"key": "stored", "status": "200"}
    assert wait_for(
        lambda: (
            total(
                scrape(stack.gateway.url + "/metrics", auth(SCRAPER)),
                "gateway_requests_total",
                **served,
            )
            == 3
        )
    )
    assert metered(stack.gateway, "stored") == moved
    assert metered(stack.twin, "stored") == (0, 0)
    # A gateway with another secret does not know the id: refused before the engine.
    seen = len(received(stack.engine))
    other = HTTP.get(
        f"{stack.stranger.url}/v1/responses/{answer['id']}", headers=auth(key), timeout=TIMEOUT
    )
    assert other.status_code == 404
    assert error_code(other) == "response_not_found"
    assert len(received(stack.engine)) == seen


def test_a_question_named_usage_is_metered(stack: Stack) -> None:
    # /v1/systemone keys `answers` and `diagnostics` by question id; `diagnostics` comes
    # after the answer's own `usage`.
    questions = {
        "ok": {"type": "noul"},
        "usage": {"type": "choice", "criteria": {"input_tokens": None, "prompt_tokens": None}},
    }
    body = {"model": stack.engine.name, "state": "The door is open.", "questions": questions}
    answers: list[httpx.Response] = []

    def ask() -> None:
        r = HTTP.post(
            stack.gateway.url + "/v1/systemone",
            headers=auth(KEYS["decisions"]),
            json=body,
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
        answers.append(r)

    moved = metered_as_counted(stack.gateway, "decisions", stack.engine, ask)
    content = answers[0].content
    assert content.rindex(b'"usage":') > content.index(b'"usage":')
    usage = answers[0].json()["usage"]
    assert moved == (usage["input_tokens"], usage["output_tokens"])


def test_an_engine_error_keeps_its_numbers(stack: Stack) -> None:
    body = {
        "model": stack.engine.name,
        "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {"99999999": 5},
    }
    r = HTTP.post(
        stack.gateway.url + "/v1/chat/completions",
        headers=auth(KEYS["scrub"]),
        json=body,
        timeout=TIMEOUT,
    )
    direct = HTTP.post(stack.engine.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == direct.status_code == 400
    message = r.json()["error"]["message"]
    assert "token_id(s) [99999999] in logit_bias" in message
    assert message == direct.json()["error"]["message"]
