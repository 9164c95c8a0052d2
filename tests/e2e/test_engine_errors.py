"""Engine error answers: a gateway under uvicorn in
front of the scripted engine of tests/e2e/test_upstream.py answering errors the way
vLLM 0.32 writes them. In process: the scrub table, tests/unit/proxy/test_scrub.py;
the traceback of an unhandled error in the gateway's log, tests/unit/test_errors.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from gateway.proxy.scrub import ADDRESS, URL, scrub
from tests.e2e.test_upstream import (
    LEAKS,
    LEAKY,
    MODEL,
    Engine,
    scripted_engine,
    scripted_gateway,
)
from tests.procs import Proc, wait_for

KEY = "sk-engine-errors-0123456789abcdef"


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
    # /load: a GET relayed as the engine sends it (a model list is always rewritten).
    return HTTP.get(gateway.url + "/load", headers=headers, timeout=10)


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
        gateway.url + "/load",
        headers={"Authorization": f"Bearer {KEY}", "X-Scenario": "sse-leaky"},
    ) as s:
        body = s.read()
    assert s.status_code == 200 and s.headers["content-type"] == "text/event-stream"
    assert body == b"data: " + json.dumps({"text": LEAKY}).encode() + b"\n\ndata: [DONE]\n\n"


# --- unhandled errors ----------------------------------------------------------------
