"""Identifiers a client names that the engine shares across tenants, through the gateway
under uvicorn in front of a simulated engine that records what it receives: request ids
and media uuids namespaced per key, and the opt-in prefix-cache isolation per tenant,
shown by the engine's own prefix-cache counters."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.samples import wav
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import Proc, gateway_proc, running, scrape, sim_proc, wait_for

KEYS = {"a1": "key-a1-0123456789abcdef", "a2": "key-a2-0123456789abcdef",
        "b1": "key-b1-0123456789abcdef", "gen": "key-gen-0123456789abcdef"}  # fmt: skip
TENANTS = {"a1": "team-a", "a2": "team-a", "b1": "team-b", "gen": "team-b"}
SCOPES = {"gen": ["inference"]}


@dataclass
class Stack:
    sim: Proc
    shared: Proc  # cache_isolation off (the default)
    isolated: Proc  # cache_isolation tenant
    http: httpx.Client

    def post(
        self, gateway: Proc, name: str, path: str, body: dict[str, Any], **headers: str
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[name]}", **headers}
        return self.http.post(gateway.url + path, json=body, headers=headers)

    def received_headers(self) -> list[dict[str, str]]:
        got = self.http.get(self.sim.url + "/sim/requests").json()
        return [r["headers"] for r in got if r["method"] == "POST"]

    def received(self) -> list[dict[str, Any]]:
        got = self.http.get(self.sim.url + "/sim/requests").json()
        return [json.loads(r["body"]) for r in got if r["method"] == "POST"]

    def clear(self) -> None:
        self.http.delete(self.sim.url + "/sim/requests")

    def paths(self) -> list[str]:
        """Paths the engine received, but for the gateways' own health checks, model
        lists and load scrapes, which run in the background."""
        got = self.http.get(self.sim.url + "/sim/requests").json()
        return [r["path"] for r in got if r["path"] not in ("/health", "/metrics", "/v1/models")]

    def hits(self) -> float:
        samples = scrape(self.sim.url + "/metrics")
        return sum(v for (name, _), v in samples.items() if name == "vllm:prefix_cache_hits_total")


def _env(sim: Proc, **extra: str) -> dict[str, str]:
    keys = [
        {"key": k, "name": n, "tenant": TENANTS[n], "scopes": SCOPES.get(n)}
        for n, k in KEYS.items()
    ]
    return {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": "identifiers-test-secret",
        **extra,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("identifiers")
    sim = sim_proc(tmp, "--record-requests", "100", "--latency", "zero")
    with running(sim):
        shared = gateway_proc(tmp, _env(sim))
        isolated = gateway_proc(tmp, _env(sim, GATEWAY_PAYLOAD__CACHE_ISOLATION="tenant"))
        with running(shared, isolated, ready_path="/healthz"), httpx.Client(timeout=10) as http:
            for gateway in (shared, isolated):
                # Ready once a health check has read the engine's models.
                assert wait_for(lambda g=gateway: http.get(g.url + "/readyz").status_code == 200)
            yield Stack(sim, shared, isolated, http)


def prompt(topic: str) -> dict[str, Any]:
    text = " ".join(f"{topic} line {i} of a long shared system prompt." for i in range(60))
    return {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": text}, {"role": "user", "content": "hi"}]}  # fmt: skip


@pytest.mark.slow
def test_request_ids_reach_the_engine_namespaced_per_key(stack: Stack) -> None:
    stack.clear()
    for name in ("a1", "a1", "b1"):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "request_id": "mine"}
        assert stack.post(stack.shared, name, "/v1/completions", body).status_code == 200
    ids = [b["request_id"] for b in stack.received()]
    assert ids[0] == ids[1] != ids[2]
    assert all(i.startswith("gw-") and "mine" not in i for i in ids)


@pytest.mark.slow
def test_media_uuids_reach_the_engine_namespaced_per_key(stack: Stack) -> None:
    stack.clear()
    part = {"type": "image_url", "image_url": None, "uuid": "cached-by-someone"}
    for name in ("a1", "b1"):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            part, {"type": "text", "text": "again"}]}]}  # fmt: skip
        stack.post(stack.shared, name, "/v1/chat/completions", body)
    uuids = [b["messages"][0]["content"][0]["uuid"] for b in stack.received()]
    assert len(uuids) == 2 and uuids[0] != uuids[1]
    assert "cached-by-someone" not in uuids


@pytest.mark.slow
def test_without_isolation_tenants_share_the_prefix_cache(stack: Stack) -> None:
    body = prompt("shared")
    assert stack.post(stack.shared, "a1", "/v1/chat/completions", body).status_code == 200
    before = stack.hits()
    assert stack.post(stack.shared, "b1", "/v1/chat/completions", body).status_code == 200
    assert stack.hits() - before > 100  # b1 hit what a1 computed: a timing side channel


@pytest.mark.slow
def test_with_tenant_isolation_only_the_same_tenant_hits(stack: Stack) -> None:
    body = prompt("isolated")
    stack.clear()
    assert stack.post(stack.isolated, "a1", "/v1/chat/completions", body).status_code == 200
    before = stack.hits()
    assert stack.post(stack.isolated, "b1", "/v1/chat/completions", body).status_code == 200
    assert stack.hits() == before  # another tenant: nothing cached for it
    assert stack.post(stack.isolated, "a2", "/v1/chat/completions", body).status_code == 200
    assert stack.hits() - before > 100  # the same tenant shares
    salts = [b["cache_salt"] for b in stack.received()]
    assert salts[0] == salts[2] != salts[1]
    # A client's own salt is kept apart from its tenant's default, and from others'.
    own = {**body, "cache_salt": "my-own-salt"}
    assert stack.post(stack.isolated, "a1", "/v1/chat/completions", own).status_code == 200
    assert stack.received()[-1]["cache_salt"] not in ("my-own-salt", *salts)


@pytest.mark.slow
def test_the_same_client_request_id_reaches_the_engine_as_two_ids(stack: Stack) -> None:
    """vLLM takes X-Request-Id as its request id and aborts by it: two tenants sending
    the same one must not share it at the engine."""
    stack.clear()
    for name in ("a1", "b1"):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        r = stack.post(stack.shared, name, "/v1/completions", body, **{"X-Request-Id": "trace-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-1"
    ids = [h["x-request-id"] for h in stack.received_headers()]
    assert len(set(ids)) == 2 and all(i.startswith("trace-1-") for i in ids)


@pytest.mark.slow
def test_invocations_need_the_pooling_scope_too(stack: Stack) -> None:
    """vLLM dispatches /invocations by the body's shape, embeddings and scoring included:
    a key with only the inference scope may not reach the pooling handlers there."""
    stack.clear()
    body = {"model": MODEL, "input": "hello"}
    r = stack.post(stack.shared, "gen", "/invocations", body)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "scope_not_allowed")
    assert "pooling" in r.json()["error"]["message"]
    assert stack.received() == []
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert stack.post(stack.shared, "gen", "/v1/chat/completions", chat).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize(
    "path", ["/cohere/v2/chat", "/v2/embed", "/v1/audio/transcriptions", "/v1/audio/translations"]
)
def test_routes_that_drop_cache_salt_are_refused_under_isolation(stack: Stack, path: str) -> None:
    def send(gateway: Proc) -> httpx.Response:
        if "/audio/" in path:
            return stack.http.post(
                gateway.url + path,
                headers={"Authorization": f"Bearer {KEYS['a1']}"},
                files={"file": ("a.wav", wav(), "audio/wav")},
                data={"model": MODEL},
            )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "texts": ["t"]}
        return stack.post(gateway, "a1", path, body)

    stack.clear()
    r = send(stack.isolated)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "endpoint_blocked")
    assert stack.paths() == []
    # Without isolation the same request is forwarded (the engine answers what it will).
    send(stack.shared)
    assert stack.paths() == [path]


# --- stored responses: bound to the key that created them --------------------------------


def _call(stack: Stack, gateway: Proc, name: str, method: str, path: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[name]}"}
    return stack.http.request(method, gateway.url + path, headers=headers)


def _create_response(stack: Stack, name: str, **fields: str) -> str:
    """The id of a response `name` creates through the shared gateway: the request id the
    engine got (it is the stored response's id; the simulated engine stores none)."""
    stack.clear()
    stack.post(stack.shared, name, "/v1/responses", {"model": MODEL, "input": "x", **fields})
    (body,) = stack.received()
    rid: str = body["request_id"]
    stack.clear()
    return rid


@pytest.mark.slow
def test_a_stored_response_is_read_and_cancelled_only_by_its_key(stack: Stack) -> None:
    """vLLM names a stored response by the body's `request_id` and serves it to whoever
    names it: the gateway gives every `POST /v1/responses` an id bound to the key, and
    forwards a retrieval or a cancel only for an id of the asking key. The binding is
    an HMAC under the shared secret: the other gateway (a replica) agrees."""
    rid = _create_response(stack, "a1")
    assert re.fullmatch(r"gw-[0-9a-f]{64}", rid)
    for gateway in (stack.shared, stack.isolated):
        for method, path in (
            ("GET", f"/v1/responses/{rid}"),
            ("POST", f"/v1/responses/{rid}/cancel"),
        ):
            for name in ("b1", "a2", "gen"):  # another tenant, the same tenant, inference only
                r = _call(stack, gateway, name, method, path)
                assert r.status_code == 404, (name, path)
                assert r.json()["error"]["code"] == "response_not_found"
            assert stack.paths() == []
            # Its own key reaches the engine (which, simulated, has no such response).
            _call(stack, gateway, "a1", method, path)
            assert stack.paths() == [path]
            stack.clear()


@pytest.mark.slow
def test_previous_response_id_must_be_the_keys_own(stack: Stack) -> None:
    """vLLM continues from the stored response `previous_response_id` names (its
    output and input messages): another key's id is refused before the engine."""
    rid = _create_response(stack, "a1", request_id="mine")
    assert _create_response(stack, "a1", request_id="mine") == rid  # the client's name, per key
    body = {"model": MODEL, "input": "more", "previous_response_id": rid}
    r = stack.post(stack.shared, "b1", "/v1/responses", body)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "response_not_found")
    assert r.json()["error"]["param"] == "previous_response_id"
    assert stack.paths() == []
    stack.post(stack.shared, "a1", "/v1/responses", body)
    (sent,) = stack.received()
    assert sent["previous_response_id"] == rid and sent["request_id"] != rid


@pytest.mark.slow
@pytest.mark.parametrize(
    "rid",
    [
        "resp_0123456789abcdef0123456789abcdef",  # vLLM's own form: made at the engine
        "gw-" + "0" * 64,
        "gw-" + "a" * 63,
        "mine",
    ],
)
def test_response_ids_not_made_for_the_key_are_refused(stack: Stack, rid: str) -> None:
    stack.clear()
    forged = _create_response(stack, "a1")
    forged = forged[:-1] + ("0" if forged[-1] != "0" else "1")  # its tag altered
    for candidate in (rid, forged):
        r = _call(stack, stack.shared, "a1", "GET", f"/v1/responses/{candidate}")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "response_not_found")
        body = {"model": MODEL, "input": "x", "previous_response_id": candidate}
        r = stack.post(stack.shared, "a1", "/v1/responses", body)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "response_not_found")
    assert stack.paths() == []


@pytest.mark.slow
@pytest.mark.parametrize("value", [True, 1, "yes"])
def test_a_background_response_is_refused(stack: Stack, value: object) -> None:
    """vLLM 0.32 answers a `background` Responses request at once and generates on: the
    key's in-flight cap counts only the answered request, and no client connection is
    left whose closing would abort the generation. Refused unless the operator opts in
    (payload.allow_background); `false` is what every request means without it."""
    stack.clear()
    body = {"model": MODEL, "input": "x", "background": value}
    r = stack.post(stack.shared, "a1", "/v1/responses", body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
        "field_not_allowed",
        "background",
    )
    assert stack.paths() == []
    body["background"] = False
    stack.post(stack.shared, "a1", "/v1/responses", body)
    assert stack.paths() == ["/v1/responses"]
    stack.clear()
