"""Every place vLLM takes the model from is checked against the key, and odd bodies never
crash routing: a gateway under uvicorn in front of two simulated engines (so the affinity
policy computes a routing key for every request)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.samples import wav
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    client_request_id,
    error_code,
    gateway_proc,
    metric,
    sim_proc,
    sim_received,
    transcribe,
    wait_for,
)

FULL = "sk-models-full-0123456789abcdef"
LIMITED = "sk-models-limited-0123456789abcdef"
OTHER = "sk-models-other-0123456789abcdef"
KEYS = [
    FULL,
    {"key": LIMITED, "name": "limited", "models": [MODEL]},
    {"key": OTHER, "name": "other", "models": ["some/other-model"]},
]


@dataclass
class Stack:
    sims: list[Proc]
    gateway: Proc

    def received(self) -> float:
        return sum(sim_received(s.url) for s in self.sims)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("model-checks")
    sims = [sim_proc(tmp, "--record-requests", "50") for _ in range(2)]
    env = {
        "GATEWAY_ENGINES": json.dumps([s.url for s in sims]),
        "GATEWAY_API_KEYS": json.dumps(KEYS),
        "GATEWAY_PUBLIC_METRICS": "true",
    }
    gateway = gateway_proc(tmp, env)
    procs = [*sims, gateway]
    try:
        for proc in procs:
            proc.start("/healthz" if proc is gateway else "/health")

        def both_healthy() -> bool:
            return metric(gateway.url, "gateway_engine_healthy") == 2

        assert wait_for(both_healthy)
        yield Stack(sims, gateway)
    finally:
        for proc in reversed(procs):
            proc.stop()


# --- the multipart `model` field ----------------------------------------------------------


def transcribe_for(stack: Stack, key: str, model: str | None) -> httpx.Response:
    return transcribe(stack.gateway.url, key, {} if model is None else {"model": model})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "model", "status", "code"),
    [
        (LIMITED, "some/other-model", 404, "model_not_found"),  # not served
        (LIMITED, None, 400, "model_required"),  # a key limited to some models must name one
        (OTHER, MODEL, 404, "model_not_found"),  # served, but not for this key
        (FULL, "../../loras/evil", 404, "model_not_found"),  # would reach the LoRA resolvers
        (FULL, "", 404, "model_not_found"),  # vLLM reads an empty name as its default model
        (FULL, MODEL + " ", 404, "model_not_found"),
    ],
)
def test_upload_model_field_is_checked(
    stack: Stack, key: str, model: str | None, status: int, code: str
) -> None:
    before = stack.received()
    r = transcribe_for(stack, key, model)
    assert (r.status_code, error_code(r)) == (status, code)
    assert stack.received() == before


@pytest.mark.slow
def test_upload_with_vllm_xargs_is_refused(stack: Stack) -> None:
    # The form twin of the JSON field: it seeds the engine request's extra args.
    before = stack.received()
    r = HTTP.post(
        stack.gateway.url + "/v1/audio/transcriptions",
        headers=auth(FULL),
        files={"file": ("a.wav", wav(), "audio/wav")},
        data={"model": MODEL, "vllm_xargs": '{"kv_transfer_params": {"remote_host": "x"}}'},
        timeout=30,
    )
    assert (r.status_code, error_code(r)) == (400, "field_not_allowed")
    assert stack.received() == before


@pytest.mark.slow
@pytest.mark.parametrize(("key", "model"), [(LIMITED, MODEL), (FULL, MODEL), (FULL, None)])
def test_upload_with_an_allowed_model_is_forwarded(
    stack: Stack, key: str, model: str | None
) -> None:
    r = transcribe_for(stack, key, model)
    assert r.status_code == 200, r.text
    assert "bytes of audio" in r.json()["text"]


# --- /invocations --------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "body", "headers", "status", "code"),
    [
        # vLLM runs its default model on /invocations whatever the body names: a key
        # limited to some models is refused there, even naming an allowed model.
        (LIMITED, CHAT, {}, 403, "model_not_allowed"),
        (LIMITED, CHAT, {"X-Amzn-SageMaker-Adapter-Identifier": MODEL}, 403,
         "model_not_allowed"),
        (OTHER, CHAT, {}, 403, "model_not_allowed"),
        # SageMaker stateful-session requests are the wrapper's, not inference.
        (FULL, {"requestType": "NEW_SESSION"}, {}, 400, "field_not_allowed"),
        (FULL, {**CHAT, "requestType": "CLOSE"}, {}, 400, "field_not_allowed"),
        (FULL, {**CHAT, "model": "../x"}, {}, 404, "model_not_found"),
        # An mcp tool's headers go to the operator's --tool-server with its session.
        (FULL, {**CHAT, "tools": [{"type": "mcp", "server_label": "browser",
                                   "headers": {"Authorization": "Bearer x"}}]}, {}, 400,
         "field_not_allowed"),
    ],
)  # fmt: skip
def test_invocations_refusals(
    stack: Stack,
    key: str,
    body: dict[str, Any],
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    before = stack.received()
    r = HTTP.post(stack.gateway.url + "/invocations", json=body, headers={**auth(key), **headers})
    assert (r.status_code, error_code(r)) == (status, code)
    assert stack.received() == before


@pytest.mark.slow
def test_invocations_for_an_unrestricted_key_never_carry_the_adapter_header(
    stack: Stack,
) -> None:
    for sim in stack.sims:
        HTTP.delete(sim.url + "/sim/requests")
    headers = {
        **auth(FULL),
        "X-Amzn-SageMaker-Adapter-Identifier": "../../loras/evil",
        "X-Amzn-SageMaker-Session-Id": "s-1",
        "X-Request-Id": "invocation-1",
    }
    r = HTTP.post(stack.gateway.url + "/invocations", json=CHAT, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    records = [
        rec
        for sim in stack.sims
        for rec in HTTP.get(sim.url + "/sim/requests").json()
        if rec["path"] == "/invocations"
    ]
    assert len(records) == 1
    assert client_request_id(records[0]["headers"]["x-request-id"]) == "invocation-1"
    assert not [h for h in records[0]["headers"] if h.startswith("x-amzn-")]


# --- routing never raises on odd shapes ---------------------------------------------------


def _part(part: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [part]}]}


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


ODD = [
    _part({"type": ["image_url"], "text": "hi"}),
    _part({"type": {"image_url": 1}, "text": "hi"}),
    _part({"type": 3, "text": "hi"}),
    _part({"type": None, "text": "hi"}),
    _part({"type": [], "image_url": {"url": "data:image/png;base64,AAAA"}}),
    _part({"type": "text", "text": ["a", {"b": 1}]}),
    {"model": MODEL, "messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}]},
    {"model": MODEL, "messages": [{"role": "user", "content": 42}]},
    {"model": MODEL, "messages": [{"role": ["user"], "content": "hi"}]},
    {"model": MODEL, "messages": {"role": "user", "content": "hi"}},
    {"model": MODEL, "messages": [[{"role": "user", "content": "hi"}]]},
    {"model": MODEL, "prompt": [None, "x"], "max_tokens": 1},
    {"model": MODEL, "prompt": [[[1, 2]]], "max_tokens": 1},
    {"model": MODEL, "prompt": _nested(200), "max_tokens": 1},
]


@pytest.mark.slow
@pytest.mark.parametrize("body", ODD)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_odd_shapes_are_answered_never_500(stack: Stack, body: dict[str, Any], path: str) -> None:
    r = HTTP.post(stack.gateway.url + path, json=body, headers=auth(FULL), timeout=30)
    assert r.status_code < 500, r.text
    assert error_code(r) != "internal_error"


@pytest.mark.slow
def test_no_unhandled_error_was_logged(stack: Stack) -> None:
    # Runs after the table above: not one request ended in the gateway's own 500.
    assert "unhandled_error" not in stack.gateway.log()


@pytest.mark.slow
def test_a_tool_with_headers_is_refused_before_the_engine(stack: Stack) -> None:
    """vLLM 0.32 sends a Responses `mcp` tool's `headers` to the operator's
    `--tool-server` with the session it opens: refused (400 field_not_allowed, the
    tool's place in `param`), nothing at the engine; the same tool without them goes on."""
    tool = {"type": "mcp", "server_label": "browser"}
    body = {"model": MODEL, "input": "hi", "tools": [tool]}
    before = stack.received()
    with_headers = {**body, "tools": [{**tool, "headers": {"Authorization": "Bearer x"}}]}
    r = HTTP.post(stack.gateway.url + "/v1/responses", json=with_headers, headers=auth(FULL))
    assert (r.status_code, error_code(r)) == (400, "field_not_allowed")
    assert r.json()["error"]["param"] == "tools[0].headers"
    assert stack.received() == before
    r = HTTP.post(stack.gateway.url + "/v1/responses", json=body, headers=auth(FULL))
    assert error_code(r) != "field_not_allowed", r.text
    assert stack.received() == before + 1
