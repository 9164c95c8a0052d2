"""Engine error answers: the scrub table (in-process), then a gateway under uvicorn in
front of the scripted engine of tests/gateway/test_gateway_upstream.py answering errors the way
vLLM 0.32 writes them; and the traceback of an unhandled error in the gateway's log."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import structlog

from bench.harness.metrics import HTTP
from gateway.errors import GatewayError
from gateway.middleware import RequestContext
from gateway.observability.logging import RequestLog, configure_logging
from gateway.observability.metrics import Metrics
from gateway.proxy.scrub import ADDRESS, URL, excerpt, scrub, scrub_json
from tests.gateway.test_gateway_upstream import (
    LEAKS,
    LEAKY,
    MODEL,
    Engine,
    scripted_engine,
    scripted_gateway,
)
from tests.procs import Proc, wait_for

KEY = "sk-engine-errors-0123456789abcdef"

SCRUB = [
    # URLs, with the sentence's punctuation kept outside.
    ("fetch http://10.0.0.1:8000/a.png failed", f"fetch {URL} failed"),
    ("see https://example.com/x?y=1#z.", f"see {URL}."),
    ("(url='http://a.b/c')", f"(url='{URL}')"),
    ("got file:///etc/passwd", f"got {URL}"),
    ("bad data:image/png;base64,iVBORw0KGgo=", f"bad {URL}"),
    ("HTTP://UPPER.EXAMPLE/X", URL),
    ("ws://[::1]:9000/socket", URL),
    ("s3://bucket/key and gs://b/k", f"{URL} and {URL}"),
    # host:port, IPv4 and IPv6, with or without a port.
    ("Cannot connect to host engine-0.svc.cluster.local:8000 ssl:default",
     f"Cannot connect to host {ADDRESS} ssl:default"),
    ("connect to localhost:5432", f"connect to {ADDRESS}"),
    ("127.0.0.1:9 refused", f"{ADDRESS} refused"),
    ("[::1]:8000 refused", f"{ADDRESS} refused"),
    ("peer 10.20.30.40 reset", f"peer {ADDRESS} reset"),
    ("resolved to 192.168.0.1.", f"resolved to {ADDRESS}."),
    ("v6 fe80::1 and ::1 and 2001:db8::8a2e:370:7334", f"v6 {ADDRESS} and {ADDRESS} and {ADDRESS}"),
    ("mapped ::ffff:127.0.0.1 here", f"mapped {ADDRESS} here"),
    ("full 2001:0db8:85a3:0000:0000:8a2e:0370:7334", f"full {ADDRESS}"),
    ("Connect call failed ('127.0.0.1', 9)", f"Connect call failed {ADDRESS}"),
    ("Connect call failed ('::1', 9, 0, 0)", f"Connect call failed {ADDRESS}"),
    ("[Errno 111] Connect call failed ('internal', 80)",
     f"[Errno 111] Connect call failed {ADDRESS}"),
    # Memory addresses.
    ("<_io.BytesIO object at 0x7f3c2c1d4a40>", f"<_io.BytesIO object at {ADDRESS}>"),
    ("at 0X7FFF0000ABCD", f"at {ADDRESS}"),
    # Left alone: what error messages legitimately say.
    ("The model `Qwen/Qwen3-VL-2B-Instruct` does not exist.",
     "The model `Qwen/Qwen3-VL-2B-Instruct` does not exist."),
    ("This model's maximum context length is 32768 tokens.",
     "This model's maximum context length is 32768 tokens."),
    ("Expecting value: line 1 column 2 (char 1)", "Expecting value: line 1 column 2 (char 1)"),
    ("max_tokens:5 must be at least 1", "max_tokens:5 must be at least 1"),
    ("at 12:30:45 on 2026-11-30", "at 12:30:45 on 2026-11-30"),
    ("ratio 16:9 and 1:2", "ratio 16:9 and 1:2"),
    ("model llama3:8b", "model llama3:8b"),
    ("version 0.32.0 of vllm", "version 0.32.0 of vllm"),
    ("invalid start byte 0xff", "invalid start byte 0xff"),
    ("metadata: none, std::vector", "metadata: none, std::vector"),
    ("a :: b", "a :: b"),
    ("", ""),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), SCRUB)
def test_scrub(text: str, expected: str) -> None:
    assert scrub(text) == expected


def test_scrub_removes_every_leak_of_a_real_shaped_message() -> None:
    cleaned = scrub(LEAKY)
    for leak in LEAKS:
        assert leak not in cleaned, leak
    assert "cannot identify image file" in cleaned and "Cannot connect to host" in cleaned


def test_scrub_is_linear_on_hostile_text() -> None:
    # Long runs that almost match: a quadratic pattern would take minutes here.
    hostile = ("a" * 60_000, "a." * 30_000 + ":", "1." * 30_000, ":" * 60_000, "0x" * 30_000,
               "a-" * 30_000 + ":1", "ab:" * 20_000)  # fmt: skip
    for text in hostile:
        assert len(scrub(text)) >= 1


def test_scrub_json_keeps_the_shape_and_scrubs_every_string() -> None:
    body = {
        "error": {"message": LEAKY, "type": "BadRequestError", "param": "url", "code": 400},
        "detail": [{"msg": "at 10.0.0.1:80", "n": 3, "ok": True, "none": None}],
        "http://k.example/": "key too",
    }
    out = orjson.loads(scrub_json(json.dumps(body).encode()) or b"")
    assert out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
    assert out["error"]["param"] == "url"
    assert out["detail"] == [{"msg": f"at {ADDRESS}", "n": 3, "ok": True, "none": None}]
    assert URL in out
    assert not any(leak in json.dumps(out) for leak in LEAKS)
    assert scrub_json(b"<html>not json</html>") is None
    deep: Any = "http://x.example/"
    for _ in range(100):
        deep = [deep]
    assert "x.example" not in (scrub_json(json.dumps(deep).encode()) or b"").decode()


def test_excerpt_is_bounded() -> None:
    assert excerpt(b"x" * 5000).endswith("...") and len(excerpt(b"x" * 5000)) == 1003
    assert excerpt(None).startswith("(not read")
    assert excerpt(b"\xff\xfe ok") == "\ufffd\ufffd ok"


# --- through the gateway -------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with scripted_engine() as e:
        yield e


@pytest.fixture(scope="module")
def gateway(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with scripted_gateway(engine, tmp_path_factory.mktemp("engine-errors"), KEY) as proc:
        yield proc


def ask(gateway: Proc, scenario: str, *, chat: bool = False) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "X-Scenario": scenario}
    if chat:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        return HTTP.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
    # /version: a GET relayed as the engine sends it (a model list is always rewritten).
    return HTTP.get(gateway.url + "/version", headers=headers, timeout=10)


def _logged(proc: Proc, request_id: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
    return [x for x in lines if x.get("request_id") == request_id]


@pytest.mark.parametrize(
    ("scenario", "status"),
    [
        ("error-500", 500),  # small, with Content-Length
        ("error-500-chunked", 500),  # the streaming path
        ("error-503-text", 503),
        ("error-404-html", 404),  # a 4xx that is not JSON
        ("error-400-big", 400),  # a 4xx over the 64 KiB cap
    ],
)
@pytest.mark.parametrize("chat", [False, True])
def test_engine_errors_are_replaced(gateway: Proc, scenario: str, status: int, chat: bool) -> None:
    r = ask(gateway, scenario, chat=chat)
    request_id = r.headers["x-request-id"]
    error = r.json()["error"]
    assert (r.status_code, error["code"]) == (status, "engine_error")
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert request_id in error["message"]
    # The random request id is ours to show; it may contain a leak's digits by chance.
    shown = r.text.replace(request_id, "<id>")
    for leak in (*LEAKS, "10.0.0.1", "Traceback", "draining", "html"):
        assert leak not in shown, leak
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    # The engine's answer is in the gateway's log, under the same request id.
    assert wait_for(lambda: len(_logged(gateway, request_id)) == 2, timeout=5)
    lines = {x["event"]: x for x in _logged(gateway, request_id)}
    assert lines["engine_error"]["status"] == status
    assert LOGGED_MARKERS[scenario] in lines["engine_error"]["body"]
    assert (lines["request"]["status"], lines["request"]["code"]) == (status, "engine_error")


# What the engine_error log line keeps of each answer (a body over the cap is not read).
LOGGED_MARKERS = {
    "error-500": "Traceback: Failed to fetch http://10.1.2.3:8080/x.png",
    "error-500-chunked": "Cannot connect to host internal-db.svc.cluster.local:5432",
    "error-503-text": "engine at 10.0.0.1:9000 is draining",
    "error-404-html": "<html>no route at 10.0.0.1:80</html>",
    "error-400-big": "(not read: over the size cap)",
}


@pytest.mark.parametrize("scenario", ["error-400", "error-400-chunked"])
@pytest.mark.parametrize("chat", [False, True])
def test_engine_4xx_keeps_its_shape_without_addresses(
    gateway: Proc, scenario: str, chat: bool
) -> None:
    r = ask(gateway, scenario, chat=chat)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "messages", 400)
    assert error["message"] == scrub(LEAKY)
    assert URL in error["message"] and ADDRESS in error["message"]
    for leak in LEAKS:
        assert leak not in r.text, leak
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)


@pytest.mark.parametrize(
    "scenario", ["error-404-model", "error-404-model-anthropic", "error-404-model-cohere"]
)
def test_an_engine_404_about_the_model_is_the_gateways_model_not_found(
    gateway: Proc, scenario: str
) -> None:
    """vLLM's 404 for a model it does not serve lists every name it serves; the client
    gets the gateway's own answer for an unknown model instead, whatever the envelope."""
    r = ask(gateway, scenario, chat=True)
    assert r.status_code == 404, r.text
    assert r.json() == {
        "error": {
            "message": f"The model `{MODEL}` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    assert "hidden-tenant-model" not in r.text


def test_engine_4xx_of_another_shape_is_scrubbed_whole(gateway: Proc) -> None:
    r = ask(gateway, "error-422-nested")
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert detail[0]["loc"] == ["body", "url"] and detail[1:] == [7, None]
    assert detail[0]["msg"] == scrub(LEAKY)


def test_successful_answers_are_relayed_byte_for_byte(gateway: Proc) -> None:
    r = ask(gateway, "ok-leaky")
    assert r.status_code == 200 and r.content == json.dumps({"text": LEAKY}).encode()
    with HTTP.stream(
        "GET",
        gateway.url + "/version",
        headers={"Authorization": f"Bearer {KEY}", "X-Scenario": "sse-leaky"},
    ) as s:
        body = s.read()
    assert s.status_code == 200 and s.headers["content-type"] == "text/event-stream"
    assert body == b"data: " + json.dumps({"text": LEAKY}).encode() + b"\n\ndata: [DONE]\n\n"


# --- unhandled errors ----------------------------------------------------------------


def test_unhandled_error_logs_its_traceback_and_tells_the_client_nothing(
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    secret_text = "internal detail 0x7f00deadbeef at /srv/gateway/state"

    async def broken_handler(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError(secret_text)

    async def call() -> httpx.Response:
        logger = structlog.get_logger("gateway")
        app = RequestContext(
            broken_handler,
            metrics=Metrics(),
            logger=logger,
            request_log=RequestLog(logger, "json", "info"),
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get("/v1/models", headers={"X-Request-Id": "req-tb-1"})

    configure_logging("json", "info")
    try:
        r = asyncio.run(call())
    finally:
        structlog.reset_defaults()
    assert r.status_code == 500
    assert r.json()["error"]["code"] == GatewayError.code == "internal_error"
    assert secret_text not in r.text and "RuntimeError" not in r.text
    lines = [orjson.loads(x) for x in capsysbinary.readouterr().out.splitlines()]
    [unhandled] = [x for x in lines if x["event"] == "unhandled_error"]
    assert unhandled["request_id"] == "req-tb-1" and unhandled["level"] == "error"
    assert unhandled["exception"].startswith("Traceback (most recent call last):")
    assert "in broken_handler" in unhandled["exception"]
    assert f"RuntimeError: {secret_text}" in unhandled["exception"]
    assert "exc_info" not in unhandled
    [request] = [x for x in lines if x["event"] == "request"]
    assert (request["status"], request["code"]) == (500, "internal_error")
