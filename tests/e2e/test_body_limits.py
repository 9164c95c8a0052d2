"""Request bodies that cost more than their size says, through the gateway under
uvicorn: a large JSON body with too many values is refused before it is parsed, one
under the cap is parsed without the collector walking it again and again; bodies held
a byte short of their end are bounded in bytes, in all and per key."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from gateway.config.settings import LimitsSettings
from gateway.proxy.body import COUNT_VALUES_OVER
from tests.procs import Proc, auth, error_code, gateway_proc, running, sim_proc, sim_received

KEY = "sk-json-bodies-0123456789abcdef"
OTHER = "sk-json-bodies-other-0123456789abcdef"
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


HELD_LIMIT = 2_000_000  # limits.max_buffered_body_bytes here; a key may hold half


@contextmanager
def _gateway(tmp: Path, **env: str) -> Iterator[tuple[Proc, Proc]]:
    """A simulated engine and the gateway in front of it, with `env` added."""
    sim = sim_proc(tmp, "--latency", "zero")
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps([KEY, OTHER]),
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
    """Just under the size that is counted: a million lists, parsed (collector paused),
    walked and forwarded; another key is served after it."""
    sim, gateway = stack
    body = _chat_with(b"[]," * ((COUNT_VALUES_OVER - 200) // 3))
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
    tmp = tmp_path_factory.mktemp("held-bodies")
    with _gateway(tmp, GATEWAY_LIMITS__MAX_BUFFERED_BODY_BYTES=str(HELD_LIMIT)) as procs:
        yield procs


@pytest.mark.slow
def test_bodies_held_short_of_their_end_are_bounded_per_key(held: tuple[Proc, Proc]) -> None:
    """Key A holds one body of 600 kB a byte short of its end, then starts another: that
    one would take A past half of the 2 MB limit and is refused 503 overloaded; key B's
    body is served meanwhile; once A's first body is gone, A is served again."""
    sim, gateway = held
    before = sim_received(sim.url)
    first = _held_body(gateway, KEY, 600_000, 900_000)
    time.sleep(0.5)
    second = _held_body(gateway, KEY, 600_000, 900_000)
    answer = _answer(second)
    second.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b'"code":"overloaded"' in answer and b"retry-after: 1" in answer.lower()
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    url = gateway.url + "/v1/chat/completions"
    padded = {**chat, "user": "b" * 500_000}
    assert HTTP.post(url, json=padded, headers=auth(OTHER), timeout=30).status_code == 200
    first.close()
    time.sleep(0.5)
    assert HTTP.post(url, json=padded, headers=auth(KEY), timeout=30).status_code == 200
    assert sim_received(sim.url) == before + 2
