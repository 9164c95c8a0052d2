"""Headers both ways by allowlist, and the cap on their number: a gateway under uvicorn in
front of the scripted engine of tests/e2e/test_upstream.py, which records every
header it receives and adds headers of its own to its answers. The `forward_headers`
setting's validation, in process: tests/unit/proxy/test_headers.py."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness.metrics import HTTP
from tests.e2e.test_upstream import MODEL, Engine, Seen, scripted_engine
from tests.procs import Proc, gateway_proc
from tests.unit.media.test_samples import wav

KEY = "sk-headers-0123456789abcdef-SECRET"
UPSTREAM = "upstream-headers-key-0123456789"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
# Every request header vLLM 0.32 or its SageMaker wrapper acts on, and others a client
# may send: none may reach an engine.
HOSTILE = {
    "endpoint-load-metrics-format": "text",
    "x-data-parallel-rank": "1",
    "x-vllm-priority": "-100",
    "x-session-id": "victim-session",
    "x-amzn-sagemaker-adapter-identifier": "../../etc/lora",
    "x-amzn-sagemaker-session-id": "s-1",
    "x-amzn-sagemaker-adapter-alias": "alias",
    "x-forwarded-for": "10.0.0.1",
    "x-forwarded-proto": "https",
    "forwarded": "for=10.0.0.1",
    "origin": "https://evil.example",
    "cookie": "session=1",
    "proxy-authorization": "Basic eA==",
    "te": "trailers",
    "x-custom": "anything",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "vendor=1",
}
# What an engine receives: the gateway's own headers and the allowlisted client ones.
ALWAYS = {"host", "content-length", "x-request-id", "authorization"}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with scripted_engine() as e:
        yield e


def _gateway(tmp: Path, engine: Engine, **extra: str) -> Proc:
    env = {
        "GATEWAY_ENGINES": f'["{engine.url}"]',
        "GATEWAY_API_KEYS": f'["{KEY}"]',
        "GATEWAY_UPSTREAM_API_KEY": UPSTREAM,
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        **extra,
    }
    return gateway_proc(tmp, env)


@pytest.fixture(scope="module")
def gateways(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    """[plain, tracing]: the defaults, and one that also forwards the tracing headers
    (and `x-scenario`, by which the scripted engine picks its answer)."""
    tmp = tmp_path_factory.mktemp("headers")
    plain = _gateway(tmp, engine)
    tracing = _gateway(
        tmp, engine, GATEWAY_FORWARD_HEADERS='["Traceparent", "tracestate", "x-scenario"]'
    )
    procs = [plain, tracing]
    try:
        for proc in procs:
            proc.start("/healthz")
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def _seen(engine: Engine, request_id: str) -> list[Seen]:
    with engine.lock:
        return [
            s
            for s in engine.seen
            if s.headers.get("x-request-id", "").rpartition("-")[0] == request_id
        ]


def _post_raw(port: int, head: list[bytes], body: bytes) -> tuple[int, bytes]:
    """A request written by hand: headers httpx would normalise or refuse go as given."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: gw", *head]
        lines.append(b"Content-Length: %d" % len(body))
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head_bytes.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += sock.recv(65536)
        return int(head_bytes.split(b" ", 2)[1]), rest


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1])
def test_engines_get_only_allowlisted_request_headers(
    engine: Engine, gateways: list[Proc], which: int
) -> None:
    gateway = gateways[which]
    request_id = f"headers-{which}"
    headers = {
        **HOSTILE,
        "Authorization": f"Bearer {KEY}",
        "Content-Type": "application/json; charset=utf-8",
        "Accept": "application/json",
        "Accept-Encoding": "gzip, br",
        "User-Agent": "OpenAI/Python 1.99",
        "X-Request-Id": request_id,
    }
    r = HTTP.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 200, r.text
    [seen] = _seen(engine, request_id)
    expected = ALWAYS | {"content-type", "accept", "user-agent"}
    if which == 1:
        expected |= {"traceparent", "tracestate"}
    assert set(seen.headers) == expected
    assert seen.headers["authorization"] == f"Bearer {UPSTREAM}"
    assert seen.headers["content-type"] == "application/json"
    assert seen.headers["user-agent"] == "OpenAI/Python 1.99"
    if which == 1:
        assert seen.headers["traceparent"] == HOSTILE["traceparent"]


@pytest.mark.slow
def test_a_connection_header_cannot_strip_the_checked_content_type(
    engine: Engine, gateways: list[Proc]
) -> None:
    # A Connection header naming content-type once removed the header after it had been
    # validated: the engine got the body without one.
    body = json.dumps(CHAT).encode()
    status, _ = _post_raw(
        gateways[0].port,
        [
            b"Authorization: Bearer " + KEY.encode(),
            b"Content-Type: application/json",
            b"Connection: content-type, x-request-id, authorization",
            b"X-Request-Id: conn-trick",
        ],
        body,
    )
    assert status == 200
    [seen] = _seen(engine, "conn-trick")
    assert seen.headers["content-type"] == "application/json"
    assert seen.headers["authorization"] == f"Bearer {UPSTREAM}"
    assert "connection" not in seen.headers and seen.body == body


@pytest.mark.slow
def test_multipart_content_type_is_the_one_checked(engine: Engine, gateways: list[Proc]) -> None:
    # The engine (scripted) answers 200; the upload must only pass the gateway's checks.
    r = HTTP.post(
        gateways[0].url + "/v1/audio/transcriptions",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "upload-1"},
        files={"file": ("a.wav", wav(), "audio/wav")},
        data={"model": MODEL},
    )
    assert r.status_code == 200, r.text
    [seen] = _seen(engine, "upload-1")
    # Written by the gateway: the boundary it parsed, quoted, and no other parameter.
    ctype = seen.headers["content-type"]
    assert ctype.startswith('multipart/form-data; boundary="') and ctype.endswith('"')
    assert seen.body.count(ctype.split("boundary=")[1].strip('"').encode()) >= 2


@pytest.mark.slow
def test_clients_get_only_allowlisted_response_headers(gateways: list[Proc]) -> None:
    # /load: a GET relayed as the engine sends it (model lists are rewritten).
    r = HTTP.get(
        gateways[1].url + "/load",
        headers={"Authorization": f"Bearer {KEY}", "X-Scenario": "headers", "X-Request-Id": "r1"},
    )
    assert r.status_code == 200 and r.json() == {"ok": "headers"}
    assert set(r.headers) == {"content-type", "content-length", "metadata", "x-request-id", "date"}
    assert r.headers["x-request-id"] == "r1"
    assert r.headers["metadata"] == '{"id":"embd-1","data":[{"index":0}]}'
    assert "endpoint-load-metrics" not in r.headers


@pytest.mark.slow
def test_header_count_is_capped_before_anything_else(engine: Engine, gateways: list[Proc]) -> None:
    with engine.lock:
        before = len(engine.seen)
    body = json.dumps(CHAT).encode()
    base = [b"Authorization: Bearer " + KEY.encode(), b"Content-Type: application/json"]
    # 100 header fields (Host and Content-Length included) are accepted ...
    filler = [b"X-Filler-%d: x" % i for i in range(96)]
    status, _ = _post_raw(gateways[0].port, [*base, *filler], body)
    assert status == 200
    with engine.lock:
        assert len(engine.seen) == before + 1
        before = len(engine.seen)
    # ... 101 are refused, and so are many more (under limits.max_header_bytes, which
    # 5,000 would pass: tests/e2e/test_connections.py); nothing reaches the engine.
    for count in (97, 2000):
        filler = [b"X-Filler-%d: x" % i for i in range(count)]
        status, answer = _post_raw(gateways[0].port, [*base, *filler], body)
        assert status == 431
        assert json.loads(answer)["error"]["code"] == "too_many_headers"
    # Before the key is even looked at.
    status, answer = _post_raw(gateways[0].port, [b"X-F-%d: x" % i for i in range(200)], b"")
    assert (status, json.loads(answer)["error"]["code"]) == (431, "too_many_headers")
    with engine.lock:
        assert len(engine.seen) == before


# --- the forward_headers setting ----------------------------------------------------------
