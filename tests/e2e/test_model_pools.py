"""Engines serving different models behind one gateway: every request goes only to the
engines that serve its model.

Real processes on loopback: two simulated chat engines serving `chat-model` (the second
also loads a LoRA adapter in one test) and a pooling engine serving `embed-model`.
Gateway G checks health every 0.2 s and reads model lists every 0.3 s; gateway S, in front
of the same engines, checks every 30 s, so an engine killed under it is still in its
rotation until a refused connection ejects it (the failover test; S routes round robin).
The tests that kill
engines come last.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.harness.metrics import HTTP
from tests.procs import (
    Proc,
    auth,
    error_code,
    gateway_proc,
    metric,
    owned_response_id,
    running,
    sim_proc,
    sim_received,
    transcribe,
    wait_for,
)

CHAT_MODEL = "chat-model"
EMBED_MODEL = "embed-model"
ADAPTER = "chat-adapter"
FULL = "sk-pools-full-0123456789abcdef"
CHAT_ONLY = "sk-pools-chat-0123456789abcdef"
KEYS = [FULL, {"key": CHAT_ONLY, "name": "chat-only", "models": [CHAT_MODEL]}]
NAMESPACE_SECRET = "model-pools-namespace-secret"
NOT_FOUND = "The model `{}` does not exist or you do not have access to it."
NOT_FOUND_NAMELESS = "The model does not exist or you do not have access to it."


@dataclass
class Fleet:
    chat_a: Proc
    chat_b: Proc
    embed: Proc
    g: Proc
    s: Proc

    @property
    def sims(self) -> list[Proc]:
        return [self.chat_a, self.chat_b, self.embed]


def _gateway_env(engines: list[str], health_interval: str, **extra: str) -> dict[str, str]:
    return {
        "GATEWAY_ENGINES": json.dumps(engines),
        "GATEWAY_API_KEYS": json.dumps(KEYS),
        "GATEWAY_PUBLIC_METRICS": "true",
        "GATEWAY_ROUTING__HEALTH_INTERVAL": health_interval,
        "GATEWAY_ROUTING__MODELS_INTERVAL": "0.3",
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": NAMESPACE_SECRET,
        **extra,
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("model-pools")
    common = ("--latency", "zero", "--record-requests", "500")
    chat_a = sim_proc(tmp, *common, "--served-model-name", CHAT_MODEL)
    chat_b = sim_proc(tmp, *common, "--served-model-name", CHAT_MODEL, "--enable-runtime-lora")
    embed = sim_proc(tmp, *common, "--runner", "pooling", "--served-model-name", EMBED_MODEL)
    engines = [chat_a.url, chat_b.url, embed.url]
    g = gateway_proc(tmp, _gateway_env(engines, "0.2"))
    # Round robin: the failover test's requests reach both chat engines, surely.
    s = gateway_proc(tmp, _gateway_env(engines, "30", GATEWAY_ROUTING__POLICY="round_robin"))
    procs = [chat_a, chat_b, embed, g, s]
    try:
        for proc in procs:
            proc.start("/healthz" if proc in (g, s) else "/health")
        for gw in (g, s):
            assert wait_for(lambda gw=gw: metric(gw.url, "gateway_engine_healthy") == 3)
        yield Fleet(chat_a, chat_b, embed, g, s)
    finally:
        for proc in reversed(procs):
            proc.stop()


def recorded(sim: Proc) -> list[dict[str, Any]]:
    """The requests `sim` received from clients (not health checks or model lists):
    path and the `model` of a JSON body (None for none)."""
    out = []
    for entry in HTTP.get(sim.url + "/sim/requests", timeout=10).json():
        if entry["path"] in ("/health", "/v1/models", "/metrics"):
            continue
        body = json.loads(entry["body"]) if entry["body"] and entry["body"][0] == "{" else {}
        out.append({"path": entry["path"], "model": body.get("model")})
    return out


def received(fleet: Fleet) -> int:
    return sum(len(recorded(sim)) for sim in fleet.sims if sim.alive())


def chat(gateway: Proc, key: str, model: str | None, text: str = "hi") -> httpx.Response:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    if model is not None:
        body["model"] = model
    return HTTP.post(gateway.url + "/v1/chat/completions", headers=auth(key), json=body, timeout=10)


def embed(gateway: Proc, key: str, model: str | None, text: str = "hi") -> httpx.Response:
    body: dict[str, Any] = {"input": text}
    if model is not None:
        body["model"] = model
    return HTTP.post(gateway.url + "/v1/embeddings", headers=auth(key), json=body, timeout=10)


def model_ids(gateway: Proc, key: str) -> list[str]:
    r = HTTP.get(gateway.url + "/v1/models", headers=auth(key), timeout=10)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


@pytest.mark.slow
def test_every_request_reaches_an_engine_serving_its_model(fleet: Fleet) -> None:
    for sim in fleet.sims:
        HTTP.delete(sim.url + "/sim/requests")
    for i in range(12):
        # Distinct prompts: the affinity policy spreads them over both chat engines.
        r = chat(fleet.g, FULL, CHAT_MODEL, f"conversation {i}: where is my parcel?")
        assert r.status_code == 200, r.text
        r = embed(fleet.g, FULL, EMBED_MODEL, f"document {i}")
        assert r.status_code == 200, r.text
    chats = [recorded(s) for s in (fleet.chat_a, fleet.chat_b)]
    assert all(r == {"path": "/v1/chat/completions", "model": CHAT_MODEL} for c in chats for r in c)
    assert sum(len(c) for c in chats) == 12
    assert recorded(fleet.embed) == [{"path": "/v1/embeddings", "model": EMBED_MODEL}] * 12


@pytest.mark.slow
def test_the_model_list_names_every_model_once(fleet: Fleet) -> None:
    # Both chat engines list chat-model: it is listed once, with the first one's entry.
    assert model_ids(fleet.g, FULL) == [CHAT_MODEL, EMBED_MODEL]
    assert model_ids(fleet.g, CHAT_ONLY) == [CHAT_MODEL]
    with openai.OpenAI(base_url=fleet.g.url + "/v1", api_key=FULL, max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [CHAT_MODEL, EMBED_MODEL]


BAD_NAMES: list[tuple[str, Any, str]] = [
    (FULL, "no/such-model", NOT_FOUND.format("no/such-model")),
    (FULL, "../../loras/evil", NOT_FOUND.format("../../loras/evil")),
    # vLLM reads an empty name as its default model.
    (FULL, "", NOT_FOUND_NAMELESS),
    (FULL, CHAT_MODEL + " ", NOT_FOUND.format(CHAT_MODEL + " ")),
    (FULL, "bad\x00name\n", NOT_FOUND_NAMELESS),
    (FULL, "x" * 257, NOT_FOUND_NAMELESS),
    (FULL, 42, NOT_FOUND_NAMELESS),
    (FULL, ["chat-model"], NOT_FOUND_NAMELESS),
    # Served, but not for this key: the very answer a model nobody serves gets.
    (CHAT_ONLY, EMBED_MODEL, NOT_FOUND.format(EMBED_MODEL)),
    (CHAT_ONLY, "no/such-model", NOT_FOUND.format("no/such-model")),
]


@pytest.mark.slow
@pytest.mark.parametrize(("key", "model", "message"), BAD_NAMES)
def test_unknown_and_forbidden_models_get_one_404(
    fleet: Fleet, key: str, model: Any, message: str
) -> None:
    before = received(fleet)
    for path in ("/v1/chat/completions", "/v1/embeddings", "/tokenize"):
        r = HTTP.post(fleet.g.url + path, headers=auth(key), json={"model": model, "input": "x"})
        assert r.status_code == 404, r.text
        assert r.json() == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "model_not_found",
            }
        }
    assert received(fleet) == before


@pytest.mark.slow
def test_an_engine_404_for_a_model_never_names_the_engines_models(tmp_path: Path) -> None:
    """vLLM 0.32 answers a model it does not serve with 404 "The model `x` does not
    exist. Valid aliases: <every name it serves>." The gateway sends a request there when
    its list is behind the engine's, or for a `served_models` name the engine's resolver
    cannot load; relayed as sent, that answer named to a key models it may not use. It is
    the gateway's own model_not_found instead, the same for every key."""
    ghost = "ghost-adapter"
    sim = sim_proc(tmp_path, "--latency", "zero", "--served-model-name", "public", "hidden")
    limited = "sk-pools-ghost-0123456789abcdef"
    keys = [FULL, {"key": limited, "name": "ghost-only", "models": ["public", ghost]}]
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_SERVED_MODELS": json.dumps([ghost]),
    }
    gw = gateway_proc(tmp_path, env)
    with running(sim):
        gw.start("/healthz")
        try:
            assert wait_for(lambda: HTTP.get(gw.url + "/readyz").status_code == 200)
            assert model_ids(gw, limited) == ["public"]
            for key in (limited, FULL):
                r = chat(gw, key, ghost)
                assert r.status_code == 404, r.text
                assert r.json() == {
                    "error": {
                        "message": NOT_FOUND.format(ghost),
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "model_not_found",
                    }
                }
                assert "hidden" not in r.text
            # The engine was asked (this is its answer, not a refusal before it).
            assert sim_received(sim.url) == 2
        finally:
            gw.stop()


@pytest.mark.slow
def test_the_openai_client_sees_model_not_found(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=fleet.g.url + "/v1", api_key=CHAT_ONLY, max_retries=0)
    with client, pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model=EMBED_MODEL, input="x")
    assert info.value.code == "model_not_found"


@pytest.mark.slow
def test_an_upload_names_its_model_like_a_body(fleet: Fleet) -> None:
    before = received(fleet)
    r = transcribe(fleet.g.url, CHAT_ONLY, {"model": EMBED_MODEL})
    assert (r.status_code, error_code(r)) == (404, "model_not_found")
    r = transcribe(fleet.g.url, FULL, {"model": "no/such-model"})
    assert (r.status_code, error_code(r)) == (404, "model_not_found")
    # No model: the engines' defaults differ (chat-model, embed-model).
    r = transcribe(fleet.g.url, FULL, {})
    assert (r.status_code, error_code(r)) == (400, "model_required")
    assert received(fleet) == before
    HTTP.delete(fleet.embed.url + "/sim/requests")
    r = transcribe(fleet.g.url, FULL, {"model": CHAT_MODEL})
    assert r.status_code == 200, r.text
    assert recorded(fleet.embed) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "method", "path", "body", "status", "code"),
    [
        # The engines' default models differ: a request must say which it is for.
        (FULL, "POST", "/v1/chat/completions", {"messages": []}, 400, "model_required"),
        (FULL, "POST", "/v1/embeddings", {"input": "x"}, 400, "model_required"),
        (FULL, "POST", "/v1/chat/completions", {"model": None, "messages": []}, 400,
         "model_required"),
        # /tokenizer_info names the engine's model path: only for `admin` keys.
        (FULL, "GET", "/tokenizer_info", None, 403, "scope_not_allowed"),
        # /invocations runs each engine's default model whatever the body names.
        (FULL, "POST", "/invocations", {"model": CHAT_MODEL, "messages": []}, 400,
         "model_required"),
        # A key limited to some models must name one, whatever the engines serve.
        (CHAT_ONLY, "POST", "/v1/chat/completions", {"messages": []}, 400, "model_required"),
        # /invocations cannot hold a key to its models: refused for such keys (the route).
        (CHAT_ONLY, "POST", "/invocations", {"model": CHAT_MODEL, "messages": []}, 403,
         "model_not_allowed"),
    ],
)  # fmt: skip
def test_a_request_without_a_model_must_be_unambiguous(
    fleet: Fleet,
    key: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    status: int,
    code: str,
) -> None:
    before = received(fleet)
    r = HTTP.request(method, fleet.g.url + path, headers=auth(key), json=body, timeout=10)
    assert (r.status_code, error_code(r)) == (status, code)
    assert r.json()["error"]["param"] == ("model" if code == "model_required" else None)
    assert received(fleet) == before


@pytest.mark.slow
def test_routes_about_an_engine_need_no_model(fleet: Fleet) -> None:
    for path in ("/load", "/health"):
        r = HTTP.get(fleet.g.url + path, headers=auth(CHAT_ONLY), timeout=10)
        assert r.status_code == 200, r.text
    # A stored response is fetched by id, naming no model: it goes to an engine (the
    # simulator stores none, and says so).
    before = received(fleet)
    path = "/v1/responses/" + owned_response_id(CHAT_ONLY, NAMESPACE_SECRET)
    r = HTTP.get(fleet.g.url + path, headers=auth(CHAT_ONLY), timeout=10)
    assert error_code(r) != "model_required" and r.status_code == 404
    assert received(fleet) == before + 1


@pytest.mark.slow
def test_an_adapter_goes_only_to_the_engine_that_lists_it(fleet: Fleet) -> None:
    load = {"lora_name": ADAPTER, "lora_path": "/srv/adapters/secret"}
    assert HTTP.post(fleet.chat_b.url + "/v1/load_lora_adapter", json=load).status_code == 200
    try:
        # Learnt at G's next model read (every 0.3 s).
        assert wait_for(lambda: ADAPTER in model_ids(fleet.g, FULL))
        listing = HTTP.get(fleet.g.url + "/v1/models", headers=auth(FULL)).json()["data"]
        assert [(m["id"], m["root"], m["parent"]) for m in listing] == [
            (CHAT_MODEL, CHAT_MODEL, None),
            (ADAPTER, ADAPTER, CHAT_MODEL),
            (EMBED_MODEL, EMBED_MODEL, None),
        ]
        # The adapter does not make the chat engines' default ambiguous, but the
        # embedding engine's different default still does.
        r = chat(fleet.g, FULL, None)
        assert (r.status_code, error_code(r)) == (400, "model_required")
        for sim in fleet.sims:
            HTTP.delete(sim.url + "/sim/requests")
        for i in range(8):
            r = chat(fleet.g, FULL, ADAPTER, f"adapter conversation {i}")
            assert r.status_code == 200, r.text
        assert recorded(fleet.chat_b) == [{"path": "/v1/chat/completions", "model": ADAPTER}] * 8
        assert recorded(fleet.chat_a) == recorded(fleet.embed) == []
        # Not the chat-only key's: the same 404 as any other model it may not use.
        r = chat(fleet.g, CHAT_ONLY, ADAPTER)
        assert (r.status_code, error_code(r)) == (404, "model_not_found")
        assert model_ids(fleet.g, CHAT_ONLY) == [CHAT_MODEL]
    finally:
        HTTP.post(fleet.chat_b.url + "/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
    assert wait_for(lambda: ADAPTER not in model_ids(fleet.g, FULL))
    r = chat(fleet.g, FULL, ADAPTER)
    assert (r.status_code, error_code(r)) == (404, "model_not_found")


@pytest.mark.slow
def test_failover_stays_within_the_models_engines(fleet: Fleet) -> None:
    # S still counts chat_a healthy (it checks every 30 s): the chat requests hashed to
    # it are refused, it is ejected, and they go to chat_b, never to the embedding engine.
    fleet.chat_a.kill()
    for sim in (fleet.chat_b, fleet.embed):
        HTTP.delete(sim.url + "/sim/requests")
    for i in range(10):
        r = chat(fleet.s, FULL, CHAT_MODEL, f"after the crash {i}")
        assert r.status_code == 200, r.text
    assert metric(fleet.s.url, "gateway_engine_ejections_total", engine=fleet.chat_a.url) == 1
    assert metric(fleet.s.url, "gateway_routing_failovers_total") == 1
    assert len(recorded(fleet.chat_b)) == 10 and recorded(fleet.embed) == []


@pytest.mark.slow
def test_a_model_whose_engines_are_all_down_is_503_while_others_work(fleet: Fleet) -> None:
    fleet.embed.kill()
    assert wait_for(
        lambda: metric(fleet.g.url, "gateway_engine_healthy", engine=fleet.embed.url) == 0
    )
    HTTP.delete(fleet.chat_b.url + "/sim/requests")
    r = embed(fleet.g, FULL, EMBED_MODEL)
    assert (r.status_code, error_code(r)) == (503, "model_unavailable")
    assert r.headers["retry-after"] == "1"
    # Unavailable is not unknown: a model no engine serves is still 404, and a key that
    # may not use the model still cannot tell it is served.
    r = embed(fleet.g, FULL, "no/such-model")
    assert (r.status_code, error_code(r)) == (404, "model_not_found")
    r = embed(fleet.g, CHAT_ONLY, EMBED_MODEL)
    assert (r.status_code, error_code(r)) == (404, "model_not_found")
    assert recorded(fleet.chat_b) == []
    # The other model is served as before; the list names what can be used now.
    r = chat(fleet.g, FULL, CHAT_MODEL)
    assert r.status_code == 200, r.text
    assert recorded(fleet.chat_b) == [{"path": "/v1/chat/completions", "model": CHAT_MODEL}]
    assert model_ids(fleet.g, FULL) == [CHAT_MODEL]
    # Its last chat engine gone too: no engine is healthy, /v1/models is "retry shortly".
    fleet.chat_b.kill()
    assert wait_for(lambda: HTTP.get(fleet.g.url + "/readyz").status_code == 503)
    r = chat(fleet.g, FULL, CHAT_MODEL)
    assert (r.status_code, error_code(r)) == (503, "model_unavailable")
    r = HTTP.get(fleet.g.url + "/v1/models", headers=auth(FULL))
    assert (r.status_code, error_code(r)) == (503, "no_engine_available")
