"""Request bodies that cost more than their size says, through the gateway under
uvicorn: a large JSON body with too many values is refused before it is parsed, one
under the cap is parsed without the collector walking it again and again; what bodies
hold in memory is bounded in bytes, in all and per key, from their first byte (held a
byte short of their end) until the engine has them (a slow engine's first byte)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from gateway.config.settings import LimitsSettings
from gateway.proxy.body import COUNT_VALUES_OVER
from tests.e2e.test_media_request_bytes import padded_png
from tests.procs import (
    Proc,
    RecordingServer,
    Route,
    auth,
    error_code,
    gateway_proc,
    media_gateway_env,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

KEY = "sk-json-bodies-0123456789abcdef"
OTHER = "sk-json-bodies-other-0123456789abcdef"
THIRD = "sk-json-bodies-third-0123456789abcdef"
MAX_VALUES = LimitsSettings().max_json_values


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _chat_with(filler: bytes) -> bytes:
    """A chat request carrying `filler` (a JSON array's elements) in a tool's schema."""
    head = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps(head)[:-1].encode() + b', "metadata_filler": [' + filler + b"0]}"


# limits.max_buffered_body_bytes and its _per_key here.
HELD_LIMIT = 1_500_000
HELD_PER_KEY = 1_000_000
HELD = {
    "GATEWAY_LIMITS__MAX_BUFFERED_BODY_BYTES": str(HELD_LIMIT),
    "GATEWAY_LIMITS__MAX_BUFFERED_BODY_BYTES_PER_KEY": str(HELD_PER_KEY),
}


@contextmanager
def _gateway(tmp: Path, *sim_opts: str, **env: str) -> Iterator[tuple[Proc, Proc]]:
    """A simulated engine (zero latency unless `sim_opts` say) and the gateway in front
    of it, with `env` added."""
    sim = sim_proc(tmp, *(sim_opts or ("--latency", "zero")))
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps([KEY, OTHER, THIRD]),
        **env,
    }
    gateway = gateway_proc(tmp, env)
    with running(sim), running(gateway, ready_path="/readyz"):
        yield sim, gateway


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    with _gateway(tmp_path_factory.mktemp("json-bodies")) as procs:
        yield procs


@pytest.mark.slow
def test_a_large_body_of_too_many_values_is_refused_before_parsing(
    stack: tuple[Proc, Proc],
) -> None:
    """32 MiB of `[],`: 11 million lists, which took the gateway to 1 GiB and held its
    event loop for seconds (7.6 s in the parser alone), then went to the engine."""
    sim, gateway = stack
    assert gateway.pid is not None
    body = _chat_with(b"[]," * 11_000_000)
    before = sim_received(sim.url)
    resp = HTTP.post(
        gateway.url + "/v1/chat/completions",
        content=body,
        headers={**auth(KEY), "Content-Type": "application/json"},
        timeout=60,
    )
    assert (resp.status_code, error_code(resp)) == (413, "request_too_large")
    assert str(MAX_VALUES) in resp.json()["error"]["message"]
    assert sim_received(sim.url) == before
    assert _status_mib(gateway.pid, "VmHWM") < 512


@pytest.mark.slow
def test_a_dense_body_under_the_cap_is_served(stack: tuple[Proc, Proc]) -> None:
    """Half the size that is counted: 700,000 lists, parsed (collector paused), walked
    and forwarded; another key is served after it. (Twice as many, 4 MiB, hold ~90 MiB
    parsed and are charged 164 MiB: 413 at a key's default body budget.)"""
    sim, gateway = stack
    body = _chat_with(b"[]," * (COUNT_VALUES_OVER // 6))
    assert len(body) <= COUNT_VALUES_OVER
    before = sim_received(sim.url)
    headers = {**auth(KEY), "Content-Type": "application/json"}
    url = gateway.url + "/v1/chat/completions"
    assert HTTP.post(url, content=body, headers=headers, timeout=60).status_code == 200
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert HTTP.post(url, json=chat, headers=auth(OTHER), timeout=30).status_code == 200
    assert sim_received(sim.url) == before + 2


def _held_body(gateway: Proc, key: str, sent: int, declared: int) -> socket.socket:
    """A chat body of `declared` bytes of which `sent` are sent, the rest held back."""
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: {auth(key)['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    conn = socket.create_connection(("127.0.0.1", gateway.port))
    conn.sendall(head.encode() + b'{"model": "' + b"m" * (sent - 11))
    return conn


def _answer(conn: socket.socket) -> bytes:
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    with _gateway(tmp_path_factory.mktemp("held-bodies"), **HELD) as procs:
        yield procs


CHAT = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def _padded(size: int, **fields: object) -> dict[str, object]:
    """A chat of about `size` bytes (ASCII: parsed, about as much again)."""
    return {**CHAT, **fields, "user": "b" * size}


@pytest.mark.slow
def test_bodies_held_short_of_their_end_are_bounded_per_key_and_in_all(
    held: tuple[Proc, Proc],
) -> None:
    """Key A holds one body of 600 kB a byte short of its end, then starts another: that
    one would take A past its 1 MB and is refused 429 too_many_body_bytes. B holds 600 kB
    too: C's 400 kB body (800 kB with its parse) would take the gateway past its 1.5 MB
    and is refused 503 overloaded. Once A's and B's bodies are gone, C and A are served.
    Nothing refused reaches the engine."""
    sim, gateway = held
    url = gateway.url + "/v1/chat/completions"
    before = sim_received(sim.url)
    first = _held_body(gateway, KEY, 600_000, 900_000)
    time.sleep(0.5)
    second = _held_body(gateway, KEY, 600_000, 900_000)
    answer = _answer(second)
    second.close()
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
    assert b'"code":"too_many_body_bytes"' in answer and b"retry-after: 1" in answer.lower()
    other = _held_body(gateway, OTHER, 600_000, 900_000)
    time.sleep(0.5)
    resp = HTTP.post(url, json=_padded(400_000), headers=auth(THIRD), timeout=30)
    assert (resp.status_code, error_code(resp)) == (503, "overloaded"), resp.text
    assert resp.headers["retry-after"] == "1"
    assert sim_received(sim.url) == before
    first.close()
    other.close()
    time.sleep(0.5)
    assert HTTP.post(url, json=_padded(400_000), headers=auth(THIRD), timeout=30).status_code == 200
    assert HTTP.post(url, json=_padded(400_000), headers=auth(KEY), timeout=30).status_code == 200
    assert sim_received(sim.url) == before + 2


@pytest.mark.slow
def test_a_body_whose_parse_would_hold_more_than_a_key_may_is_413(
    held: tuple[Proc, Proc],
) -> None:
    """300 kB of `[],` parse into ~20 MB (80 bytes charged a value): more than a key's
    1 MB whatever else it holds, so 413, not a 429 to retry; nothing parsed or
    forwarded. A 300 kB chat of text is served."""
    sim, gateway = held
    before = sim_received(sim.url)
    headers = {**auth(KEY), "Content-Type": "application/json"}
    url = gateway.url + "/v1/chat/completions"
    resp = HTTP.post(url, content=_chat_with(b"[]," * 100_000), headers=headers, timeout=30)
    assert (resp.status_code, error_code(resp)) == (413, "request_too_large"), resp.text
    assert str(HELD_PER_KEY) in resp.json()["error"]["message"]
    assert sim_received(sim.url) == before
    assert HTTP.post(url, json=_padded(300_000), headers=auth(KEY), timeout=30).status_code == 200
    assert sim_received(sim.url) == before + 1


# --- bodies held until the engine has them -------------------------------------------------

# A chat the simulated engine (calibrated latency) decodes for ~4 s: 500 tokens of 8 ms.
SLOW = {"max_tokens": 500, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    with _gateway(tmp_path_factory.mktemp("slow-engine"), "--max-num-seqs", "1", **HELD) as p:
        yield p


@pytest.mark.slow
def test_a_body_stays_charged_until_the_engine_answers(slow_engine: tuple[Proc, Proc]) -> None:
    """Key A's 400 kB chat is at an engine that has not answered yet (it decodes 500
    tokens before its first byte): A's next 400 kB chat (800 kB with its parse) would
    take A past its 1 MB and is refused 429 too_many_body_bytes, nothing of it at the
    engine. Before, a body was charged only while it arrived: both went to the engine.
    Another key is served."""
    sim, gateway = slow_engine
    url = gateway.url + "/v1/chat/completions"
    before = sim_received(sim.url)
    answers: list[httpx.Response] = []
    held = threading.Thread(
        target=lambda: answers.append(
            HTTP.post(url, json=_padded(400_000, **SLOW), headers=auth(KEY), timeout=60)
        )
    )
    held.start()
    try:
        assert wait_for(lambda: sim_received(sim.url) == before + 1, timeout=30)
        resp = HTTP.post(url, json=_padded(400_000), headers=auth(KEY), timeout=30)
        assert (resp.status_code, error_code(resp)) == (429, "too_many_body_bytes"), resp.text
        assert resp.headers["retry-after"] == "1"
        assert sim_received(sim.url) == before + 1
    finally:
        held.join()
    assert [a.status_code for a in answers] == [200]
    assert HTTP.post(url, json=_padded(400_000), headers=auth(OTHER), timeout=30).status_code == 200


@pytest.mark.slow
def test_a_body_is_given_back_once_the_engine_answers(slow_engine: tuple[Proc, Proc]) -> None:
    """Key A's 250 kB chat streams for ~4 s: once its first event has arrived the engine
    has the body, which the gateway no longer holds, and A's next 400 kB chat is served
    while the stream goes on (the gateway would refuse it if the first were still
    charged: the test above). The stream's body is rewritten (the gateway asks the
    engine for usage), and old and new bytes are held together for a moment: 250 kB
    keeps that within the key's 1 MB."""
    sim, gateway = slow_engine
    url = gateway.url + "/v1/chat/completions"
    before = sim_received(sim.url)
    body = _padded(250_000, stream=True, max_tokens=500, ignore_eos=True)
    with HTTP.stream("POST", url, json=body, headers=auth(KEY), timeout=60) as stream:
        assert stream.status_code == 200
        events = stream.iter_lines()
        assert next(line for line in events if line.startswith("data: "))
        # The sim runs one request at a time: this one waits for the stream's end.
        resp = HTTP.post(url, json=_padded(400_000), headers=auth(KEY), timeout=60)
        assert resp.status_code == 200, resp.text
        assert [line for line in events if line][-1] == "data: [DONE]"
    assert sim_received(sim.url) == before + 2


# --- the body rewritten after media inlining ------------------------------------------------

MEDIA_ITEM = 300_000


@pytest.mark.slow
def test_the_body_rewritten_with_inlined_media_is_charged(tmp_path: Path) -> None:
    """A chat of a few hundred bytes naming images of 300 kB: inlined, each is a 400 kB
    data: URL in the forwarded body and in the parsed object. One image (800 kB charged)
    fits a key's 1 MB and is served; two (1.6 MB) never can: 413 request_too_large, with
    nothing at the engine. Before, the rewritten body was never charged: both went."""
    image = padded_png(MEDIA_ITEM)
    route = Route(body=image, headers={"Content-Type": "image/png"})
    with RecordingServer({"/a.png": route, "/b.png": route}) as origin:
        host = origin.url.split("//", 1)[1]
        sim = sim_proc(tmp_path, "--latency", "zero")
        gateway = gateway_proc(tmp_path, media_gateway_env(sim.url, KEY, host, "http", **HELD))
        with running(sim), running(gateway, ready_path="/readyz"):
            url = gateway.url + "/v1/chat/completions"

            def ask(names: str) -> httpx.Response:
                parts: list[dict[str, object]] = [
                    {"type": "image_url", "image_url": {"url": f"{origin.url}/{n}.png"}}
                    for n in names
                ]
                content = [*parts, {"type": "text", "text": "?"}]
                body = {**CHAT, "messages": [{"role": "user", "content": content}]}
                return HTTP.post(url, json=body, headers=auth(KEY), timeout=30)

            before = sim_received(sim.url)
            resp = ask("ab")
            assert (resp.status_code, error_code(resp)) == (413, "request_too_large"), resp.text
            assert sim_received(sim.url) == before
            assert ask("a").status_code == 200
            assert sim_received(sim.url) == before + 1
