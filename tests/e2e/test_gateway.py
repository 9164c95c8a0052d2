"""The gateway under uvicorn in front of real simulated engines, on loopback.

One module-scoped stack serves every test here: two generate engines behind gateway G
(health checks every 30 s, so a killed engine stays in the pool until a connection to it
is refused), a pooling engine behind gateway P, and gateway E whose only engine is dead.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.harness.metrics import HTTP
from bench.harness.samples import wav
from bench.sim.config import DEFAULT_MODEL as MODEL
from gateway.access.endpoints import TABLE, Action, BodyKind, Group
from tests.procs import (
    Proc,
    auth,
    client_request_id,
    error_code,
    gateway_proc,
    held_streams,
    owned_response_id,
    scrape,
    sim_proc,
    wait_for,
)

EXTRA_MODEL = "configured/extra-model"
UPSTREAM = "upstream-secret-key-0123456789"
FULL = "sk-full-0123456789abcdef-SECRET"
# Every forwarded group and `admin`, which the engine's /version and /tokenizer_info need.
WITH_ADMIN = "sk-with-admin-0123456789abcdef"
POOLING_ONLY = "sk-pooling-0123456789abcdef-SECRET"
METRICS_ONLY = "sk-metrics-0123456789abcdef-SECRET"
OTHER_MODEL = "sk-othermodel-0123456789abcdef-SECRET"
FILE_A = "sk-file-a-0123456789abcdef-SECRET"
FILE_B = "sk-file-b-0123456789abcdef-SECRET"
PROMPT_MARKER = "PROMPT-MARKER-7f3a"
DATA_URL = "data:image/png;base64," + "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJ" * 4
MAX_BODY = 100_000
MAX_UPLOAD = 200_000
MAX_IN_FLIGHT = 3
NAMESPACE_SECRET = "gateway-test-namespace-secret"
# A stored response of the full key's (the engines, simulated, store none).
RESPONSE_ID = owned_response_id(FULL, NAMESPACE_SECRET)
KEYS = json.dumps(
    [
        FULL,
        {"key": POOLING_ONLY, "name": "pooling-only", "scopes": ["pooling"]},
        {"key": METRICS_ONLY, "name": "metrics-only", "scopes": ["metrics"]},
        {
            "key": WITH_ADMIN,
            "name": "with-admin",
            "scopes": [g.value for g in Group if g is not Group.metrics],
        },
        {"key": OTHER_MODEL, "name": "other-model", "models": ["some/other-model"]},
    ]
)


@dataclass
class Stack:
    gen: Proc
    victim: Proc
    pool_sim: Proc
    doomed: Proc
    g: Proc
    p: Proc
    e: Proc
    key_file: Path

    @property
    def gen_sims(self) -> list[Proc]:
        return [s for s in (self.gen, self.victim) if s.alive()]


def _gateway_env(engines: list[str], **extra: str) -> dict[str, str]:
    return {
        "GATEWAY_ENGINES": json.dumps(engines),
        "GATEWAY_API_KEYS": KEYS,
        "GATEWAY_UPSTREAM_API_KEY": UPSTREAM,
        "GATEWAY_LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
        "GATEWAY_LIMITS__MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": NAMESPACE_SECRET,
        # Every test here calls from 127.0.0.1, and many send wrong keys on purpose: the
        # failure throttle has its own tests (test_callers.py).
        "GATEWAY_LIMITS__AUTH_FAILURES": "0",
        **extra,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gateway")
    key_file = tmp / "keys.yaml"
    key_file.write_text(f"- key: {FILE_A}\n  name: file-a\n")
    sim_opts = ("--api-key", UPSTREAM, "--record-requests", "200")
    gen = sim_proc(tmp, *sim_opts)
    victim = sim_proc(tmp, *sim_opts)
    pool_sim = sim_proc(tmp, "--runner", "pooling", "--api-key", UPSTREAM)
    g = gateway_proc(
        tmp,
        _gateway_env(
            [gen.url, victim.url],
            GATEWAY_API_KEYS_FILE=str(key_file),
            GATEWAY_LIMITS__MAX_IN_FLIGHT=str(MAX_IN_FLIGHT),
            # A plain engine choice; the affinity policy has its own tests.
            GATEWAY_ROUTING__POLICY="round_robin",
        ),
    )
    p = gateway_proc(tmp, _gateway_env([pool_sim.url]))
    # E's only engine is killed by the tests below; its first-byte timeout is short.
    doomed = sim_proc(tmp, "--api-key", UPSTREAM)
    e = gateway_proc(
        tmp,
        _gateway_env(
            [doomed.url],
            GATEWAY_SERVED_MODELS=json.dumps([EXTRA_MODEL]),
            GATEWAY_TIMEOUTS__FIRST_BYTE="0.5",
        ),
    )
    procs = [gen, victim, pool_sim, doomed, g, p, e]
    try:
        for proc in procs:
            proc.start("/healthz" if proc in (g, p, e) else "/health")
        for gw in (g, p):
            assert wait_for(lambda gw=gw: HTTP.get(gw.url + "/readyz").status_code == 200)
        yield Stack(gen, victim, pool_sim, doomed, g, p, e, key_file)
    finally:
        for proc in reversed(procs):
            proc.stop()


def received(sims: list[Proc]) -> dict[str, float]:
    """Requests per path the engines received, minus scrapes of /metrics."""
    out: dict[str, float] = {}
    for sim in sims:
        for (name, labels), value in scrape(sim.url + "/metrics").items():
            if name == "sim:received_requests_total":
                path = dict(labels)["path"]
                if path != "/metrics":
                    out[path] = out.get(path, 0) + value
    return out


def total(counts: dict[str, float]) -> float:
    return sum(counts.values())


def aborted(sims: list[Proc]) -> float:
    return sum(scrape(s.url + "/metrics").get(("sim:aborted_requests_total", ()), 0) for s in sims)


def recorded(sims: list[Proc]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for sim in sims:
        out += [r for r in HTTP.get(sim.url + "/sim/requests").json() if r["path"] != "/metrics"]
    return out


def clear_records(sims: list[Proc]) -> None:
    for sim in sims:
        HTTP.delete(sim.url + "/sim/requests")


# --- the route matrix ------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def request_for(path: str, method: str) -> dict[str, Any]:
    """A well-formed request for a table route."""
    route = TABLE.get(path)
    if route is not None and route.body is BodyKind.json:
        return {"json": CHAT}
    if route is not None and route.body is BodyKind.multipart:
        return {
            "files": {"file": ("a.wav", wav(), "audio/wav")},
            "data": {"model": MODEL},
        }
    return {}


FORWARDED = sorted(
    [(r.path, m) for r in TABLE.values() if r.action is Action.forward for m in sorted(r.methods)]
    + [(f"/v1/responses/{RESPONSE_ID}", "GET"), (f"/v1/responses/{RESPONSE_ID}/cancel", "POST")]
)
BLOCKED = sorted(
    [(r.path, "POST") for r in TABLE.values() if r.action is Action.blocked]
    + [
        ("/adapters/my-lora", "DELETE"),
        ("/fault_tolerance/apply", "POST"),
        ("/inference/v1/generate", "POST"),
        ("/update_weights_from_disk", "POST"),
    ]
)
UNKNOWN = [("/v1/files", "GET"), ("/", "GET"), ("/v1/chat", "POST"), ("/admin", "GET")]


@pytest.mark.slow
def test_route_matrix_refusals_never_reach_an_engine(stack: Stack) -> None:
    """Every route x {no key, wrong key, key without the scope}: status, code, and
    the engines' received counters unchanged."""
    before = received(stack.gen_sims)
    seen = 0
    with httpx.Client(base_url=stack.g.url, timeout=10) as client:
        for headers in ({}, auth("sk-wrong-0123456789abcdef"), auth(METRICS_ONLY)):
            for path, method in FORWARDED:
                r = client.request(method, path, headers=headers, **request_for(path, method))
                if headers.get("Authorization", "").endswith(METRICS_ONLY):
                    assert (r.status_code, error_code(r)) == (403, "scope_not_allowed"), path
                else:
                    assert (r.status_code, error_code(r)) == (401, "invalid_api_key"), path
                    assert r.headers["www-authenticate"] == "Bearer"
                seen += 1
            for path, method in BLOCKED:
                r = client.request(method, path, headers=headers, json=CHAT)
                assert (r.status_code, error_code(r)) == (403, "endpoint_blocked"), path
                seen += 1
            for path, method in UNKNOWN:
                r = client.request(method, path, headers=headers)
                assert (r.status_code, error_code(r)) == (404, "unknown_endpoint"), path
                seen += 1
    assert seen > 150
    assert received(stack.gen_sims) == before


@pytest.mark.slow
def test_route_matrix_right_key_forwards_the_canonical_path(stack: Stack) -> None:
    clear_records(stack.gen_sims)
    before = total(received(stack.gen_sims))
    with httpx.Client(base_url=stack.g.url, timeout=10) as client:
        for path, method in FORWARDED:
            admin = TABLE[path].group is Group.admin if path in TABLE else False
            key = WITH_ADMIN if admin else FULL
            r = client.request(method, path, headers=auth(key), **request_for(path, method))
            # The engine answered (some routes only exist on a pooling engine): never a
            # refusal of the gateway's own.
            assert error_code(r) not in ("invalid_api_key", "endpoint_blocked", "scope_not_allowed")
            assert r.status_code != 401, path  # the engine accepted the upstream key
        # The right key on a blocked route is still blocked.
        r = client.post("/v1/load_lora_adapter", headers=auth(FULL), json={"lora_name": "x"})
        assert (r.status_code, error_code(r)) == (403, "endpoint_blocked")
    assert total(received(stack.gen_sims)) - before == len(FORWARDED)
    records = recorded(stack.gen_sims)
    assert sorted((r["method"], r["path"]) for r in records) == sorted((m, p) for p, m in FORWARDED)
    for rec in records:
        assert rec["headers"]["authorization"] == f"Bearer {UPSTREAM}"
        assert rec["headers"]["x-request-id"]
        assert "connection" not in rec["headers"] or rec["headers"]["connection"] == "keep-alive"


@pytest.mark.slow
def test_gateway_metrics_need_the_metrics_scope(stack: Stack) -> None:
    before = received(stack.gen_sims)
    r = HTTP.get(stack.g.url + "/metrics")
    assert (r.status_code, error_code(r)) == (401, "invalid_api_key")
    # A key without scopes gets every forwarded group, but not the metrics.
    r = HTTP.get(stack.g.url + "/metrics", headers=auth(FULL))
    assert (r.status_code, error_code(r)) == (403, "scope_not_allowed")
    r = HTTP.get(stack.g.url + "/metrics", headers=auth(METRICS_ONLY))
    assert r.status_code == 200
    assert "gateway_requests_total" in r.text and "gateway_engine_healthy" in r.text
    assert "sim:" not in r.text and "vllm:" not in r.text  # never the engine's metrics
    samples = scrape(stack.g.url + "/metrics", auth(METRICS_ONLY))
    rejected = samples[("gateway_rejections_total", (("code", "endpoint_blocked"),))]
    assert rejected > 0
    assert received(stack.gen_sims) == before


@pytest.mark.slow
def test_own_routes_need_no_key(stack: Stack) -> None:
    assert HTTP.get(stack.g.url + "/healthz").json() == {"status": "ok"}
    r = HTTP.get(stack.g.url + "/readyz")
    assert r.status_code == 200 and r.json()["healthy_engines"] == 2


PATH_TRICKS = [
    ("//v1/chat/completions", 404, "unknown_endpoint"),
    ("/v1//chat/completions", 404, "unknown_endpoint"),
    ("/v1/chat/completions/", 404, "unknown_endpoint"),
    ("/v1/./chat/completions", 404, "unknown_endpoint"),
    ("/v1/x/../chat/completions", 404, "unknown_endpoint"),
    ("/V1/chat/completions", 404, "unknown_endpoint"),
    ("/v1/chat%2fcompletions", 404, "unknown_endpoint"),
    ("/v1/chat/completions%00", 404, "unknown_endpoint"),
    ("/v1/chat/completions;a=b", 404, "unknown_endpoint"),
    ("/%76%31/chat/completions", 404, "unknown_endpoint"),
    ("/v1/chat/completions/render", 403, "endpoint_blocked"),
    ("/v1/load_lora_adapter/", 403, "endpoint_blocked"),
    ("//v1/load_lora_adapter", 403, "endpoint_blocked"),
    ("/V1/Load_Lora_Adapter", 403, "endpoint_blocked"),
    ("/v1/%6coad_lora_adapter", 403, "endpoint_blocked"),
    ("/v1/%256coad_lora_adapter", 403, "endpoint_blocked"),
    ("/v1/chat/../load_lora_adapter", 403, "endpoint_blocked"),
    ("/v1/models/..%2fload_lora_adapter", 403, "endpoint_blocked"),
    ("/adapters;x=1", 403, "endpoint_blocked"),
    ("/x/%2e%2e/collective_rpc", 403, "endpoint_blocked"),
    ("/inference/v1/generate", 403, "endpoint_blocked"),
    ("/metrics/", 404, "unknown_endpoint"),
]


def _raw_request(port: int, path: str, key: str) -> tuple[int, bytes]:
    """Send `path` byte for byte: HTTP clients normalise paths before sending them."""
    body = json.dumps(CHAT).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.mark.slow
def test_path_tricks_never_reach_an_engine(stack: Stack) -> None:
    before = received(stack.gen_sims)
    for path, status, code in PATH_TRICKS:
        got, body = _raw_request(stack.g.port, path, FULL)
        assert (got, json.loads(body)["error"]["code"]) == (status, code), path
    assert received(stack.gen_sims) == before


# --- bodies, models, limits ---------------------------------------------------------


def _chat(client: httpx.Client, key: str = FULL, **body: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", headers=auth(key), json={**CHAT, **body})


BAD_MODELS = ["../x", "../../etc/passwd", "some/other-model", "", 42, None, ["a"]]


@pytest.mark.slow
def test_model_must_be_served_and_allowed(stack: Stack) -> None:
    before = received(stack.gen_sims)
    with httpx.Client(base_url=stack.g.url, timeout=10) as client:
        for model in BAD_MODELS:
            if model is None:
                continue
            r = _chat(client, model=model)
            assert (r.status_code, error_code(r)) == (404, "model_not_found"), model
        # A key limited to another model may not use the served one, nor leave it out.
        r = _chat(client, OTHER_MODEL)
        assert (r.status_code, error_code(r)) == (404, "model_not_found")
        body = {k: v for k, v in CHAT.items() if k != "model"}
        r = client.post("/v1/chat/completions", headers=auth(OTHER_MODEL), json=body)
        assert (r.status_code, error_code(r)) == (400, "model_required")
    assert received(stack.gen_sims) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "content_type", "status", "code"),
    [
        (b"{not json", "application/json", 400, "invalid_json"),
        (b"", "application/json", 400, "invalid_json"),
        (b"[1, 2]", "application/json", 400, "invalid_json"),
        (b'"text"', "application/json", 400, "invalid_json"),
        (b"\xff\xfe", "application/json", 400, "invalid_json"),
        (json.dumps(CHAT).encode(), "text/plain", 415, "unsupported_media_type"),
        (
            json.dumps(CHAT).encode(),
            "application/x-www-form-urlencoded",
            415,
            "unsupported_media_type",
        ),
    ],
)
def test_bad_bodies(
    stack: Stack, content: bytes, content_type: str, status: int, code: str
) -> None:
    before = received(stack.gen_sims)
    r = HTTP.post(
        stack.g.url + "/v1/chat/completions",
        content=content,
        headers={**auth(FULL), "Content-Type": content_type},
    )
    assert (r.status_code, error_code(r)) == (status, code)
    assert received(stack.gen_sims) == before


@pytest.mark.slow
def test_body_cap_with_and_without_content_length(stack: Stack) -> None:
    before = received(stack.gen_sims)
    big = json.dumps({**CHAT, "pad": "x" * MAX_BODY}).encode()
    r = HTTP.post(
        stack.g.url + "/v1/chat/completions",
        content=big,
        headers={**auth(FULL), "Content-Type": "application/json"},
    )
    assert (r.status_code, error_code(r)) == (413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = HTTP.post(
        stack.g.url + "/v1/chat/completions",
        content=chunks(),
        headers={**auth(FULL), "Content-Type": "application/json"},
    )
    assert (r.status_code, error_code(r)) == (413, "request_too_large")
    # Uploads have their own cap.
    files = {"file": ("a.wav", b"\0" * (MAX_UPLOAD + 1), "audio/wav")}
    r = HTTP.post(stack.g.url + "/v1/audio/transcriptions", headers=auth(FULL), files=files)
    assert (r.status_code, error_code(r)) == (413, "request_too_large")
    assert received(stack.gen_sims) == before
    # Just under the cap passes.
    r = HTTP.post(
        stack.g.url + "/v1/chat/completions",
        content=json.dumps({**CHAT, "pad": "x" * (MAX_BODY - 200)}),
        headers={**auth(FULL), "Content-Type": "application/json"},
    )
    assert r.status_code == 200


@pytest.mark.slow
def test_valid_upload_is_forwarded(stack: Stack) -> None:
    audio = wav(25_000)
    files = {"file": ("a.wav", audio, "audio/wav")}
    r = HTTP.post(
        stack.g.url + "/v1/audio/transcriptions",
        headers=auth(FULL),
        files=files,
        data={"model": MODEL},
    )
    assert r.status_code == 200, r.text
    assert f"{len(audio)} bytes" in r.json()["text"]


# --- request ids, headers -------------------------------------------------------------


@pytest.mark.slow
def test_request_id_taken_or_minted_and_sent_to_the_engine(stack: Stack) -> None:
    clear_records(stack.gen_sims)
    with httpx.Client(base_url=stack.g.url, timeout=10) as client:
        r = client.post(
            "/v1/chat/completions",
            headers={**auth(FULL), "X-Request-Id": "client-id-1", "Proxy-Authorization": "x"},
            json=CHAT,
        )
        assert r.headers["x-request-id"] == "client-id-1"
        bad = client.post(
            "/v1/chat/completions", headers={**auth(FULL), "X-Request-Id": "bad id\t!"}, json=CHAT
        )
        minted = bad.headers["x-request-id"]
        assert minted != "bad id\t!" and len(minted) == 32
        refused = client.get("/nope")
        assert len(refused.headers["x-request-id"]) == 32
    ids = sorted(rec["headers"]["x-request-id"] for rec in recorded(stack.gen_sims))
    # The client's own id reaches the engine made unique (vLLM aborts by request id);
    # a minted one is already ours and goes as it is.
    assert minted in ids
    [own] = [i for i in ids if i != minted]
    assert own.startswith("client-id-1-") and client_request_id(own) == "client-id-1"
    for rec in recorded(stack.gen_sims):
        assert FULL not in json.dumps(rec)
        assert "proxy-authorization" not in rec["headers"]


# --- streaming and disconnects ---------------------------------------------------------


@pytest.mark.slow
def test_streaming_arrives_incrementally(stack: Stack) -> None:
    arrivals: list[float] = []
    body = {**CHAT, "max_tokens": 150, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    with HTTP.stream(
        "POST", stack.g.url + "/v1/chat/completions", headers=auth(FULL), json=body, timeout=30
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = ""
        for chunk in r.iter_text():
            arrivals.append(time.perf_counter() - start)
            frames += chunk
    assert frames.rstrip().endswith("data: [DONE]")
    # 150 simulated decode steps: the first chunk comes long before the last.
    assert len(arrivals) > 20
    assert arrivals[-1] - arrivals[0] > 0.3
    assert arrivals[0] < arrivals[-1] / 3


@pytest.mark.slow
def test_client_disconnect_aborts_the_engine_request(stack: Stack) -> None:
    # A stream's client that leaves ends its engine request. (A non-streamed request
    # whose client leaves before its answer starts runs on, to be metered:
    # tests/e2e/test_metering.py.)
    before = aborted(stack.gen_sims)
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=stack.g.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", headers=auth(FULL), json=body) as r,
    ):
        assert r.status_code == 200
        next(r.iter_raw())
    # The client closed its connection; the engine must see its request aborted.
    assert wait_for(lambda: aborted(stack.gen_sims) > before, timeout=10)


@pytest.mark.slow
def test_in_flight_cap_answers_503(stack: Stack) -> None:
    async def scenario() -> tuple[httpx.Response, float]:
        body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with (
            httpx.AsyncClient(base_url=stack.g.url, timeout=30) as client,
            held_streams(client, MAX_IN_FLIGHT, FULL, body),
        ):
            before = total(received(stack.gen_sims))
            over = await client.post("/v1/chat/completions", headers=auth(FULL), json=CHAT)
            return over, total(received(stack.gen_sims)) - before

    over, delta = asyncio.run(scenario())
    assert (over.status_code, error_code(over)) == (503, "overloaded")
    assert over.headers["retry-after"] == "1"
    assert delta == 0
    # The slots come back when the streams end.
    with httpx.Client(base_url=stack.g.url) as client:
        assert wait_for(lambda: _chat(client).status_code == 200)


# --- the OpenAI client -----------------------------------------------------------------


@pytest.mark.slow
def test_openai_client_chat(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.g.url + "/v1", api_key=FULL, max_retries=0)
    with client:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        assert out.choices[0].message.content
        pieces = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=5,
                stream=True,
            )
            if c.choices
        ]
        assert "".join(pieces)
        assert [m.id for m in client.models.list()] == [MODEL]
        wrong = openai.OpenAI(
            base_url=stack.g.url + "/v1", api_key="sk-wrong-0123456789", max_retries=0
        )
        with wrong, pytest.raises(openai.AuthenticationError):
            wrong.models.list()


@pytest.mark.slow
def test_openai_client_embeddings_and_rerank(stack: Stack) -> None:
    with openai.OpenAI(base_url=stack.p.url + "/v1", api_key=POOLING_ONLY, max_retries=0) as c:
        models = HTTP.get(stack.p.url + "/v1/models", headers=auth(FULL)).json()
        model = models["data"][0]["id"]
        emb = c.embeddings.create(model=model, input=["a sentence", "another one"])
        assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
        ranked = c.post(
            "/../rerank",
            cast_to=object,
            body={"model": model, "query": "q", "documents": ["d1", "d2", "d3"]},
        )
        assert isinstance(ranked, dict) and len(ranked["results"]) == 3
        # The pooling-only key may not generate text.
        with pytest.raises(openai.PermissionDeniedError) as info:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        assert info.value.code == "scope_not_allowed"


# --- engine failures -------------------------------------------------------------------


@pytest.mark.slow
def test_configured_models_are_accepted_and_slow_engines_time_out(stack: Stack) -> None:
    before = received([stack.doomed])
    aborts = aborted([stack.doomed])
    with httpx.Client(base_url=stack.e.url, headers=auth(FULL), timeout=10) as client:
        # Not listed by the engine, but configured: forwarded. The engine does not serve
        # it either: its 404 comes back as model_not_found, without the engine's names.
        r = client.post("/v1/chat/completions", json={**CHAT, "model": EXTRA_MODEL})
        assert (r.status_code, error_code(r)) == (404, "model_not_found"), r.text
        assert MODEL not in r.text
        assert total(received([stack.doomed])) == total(before) + 1
        # 300 decode steps take longer than E's 0.5 s first-byte timeout.
        slow = {**CHAT, "max_tokens": 300, "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=slow)
        assert (r.status_code, error_code(r)) == (504, "upstream_timeout")
    # The gateway closed the upstream connection: the engine aborted the request.
    assert wait_for(lambda: aborted([stack.doomed]) > aborts, timeout=10)


@pytest.mark.slow
def test_stream_broken_midway_ends_with_an_error_frame(stack: Stack) -> None:
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with HTTP.stream(
        "POST", stack.e.url + "/v1/chat/completions", headers=auth(FULL), json=body, timeout=10
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        stack.doomed.kill()
        rest = [line for line in lines if line]
    assert rest[-1].startswith("data: {")
    assert json.loads(rest[-1][len("data: ") :])["error"]["code"] == "upstream_broken"
    assert "[DONE]" not in rest[-1]


@pytest.mark.slow
def test_dead_engine_is_502_then_503(stack: Stack) -> None:
    # Runs after the test above killed E's only engine.
    assert not stack.doomed.alive()
    # Refused while still counted healthy: tried and failed.
    r = HTTP.post(stack.e.url + "/v1/chat/completions", headers=auth(FULL), json=CHAT)
    assert (r.status_code, error_code(r)) == (502, "upstream_unavailable")
    # Ejected: the model has no engine left, so nothing is tried ("retry shortly").
    r = HTTP.post(stack.e.url + "/v1/chat/completions", headers=auth(FULL), json=CHAT)
    assert (r.status_code, error_code(r)) == (503, "model_unavailable")
    assert r.headers["retry-after"] == "1"
    assert HTTP.get(stack.e.url + "/readyz").status_code == 503


@pytest.mark.slow
def test_engine_4xx_keeps_its_shape(stack: Stack) -> None:
    # The engine's own validation error, in vLLM's shape (`code` the status as an
    # integer): relayed with its meaning, its strings scrubbed
    # (tests/e2e/test_engine_errors.py).
    r = HTTP.post(
        stack.g.url + "/v1/chat/completions",
        headers=auth(FULL),
        json={**CHAT, "max_tokens": -5},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == 400 and "max_tokens" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


# --- keys: reload without restart ------------------------------------------------------


@pytest.mark.slow
def test_key_file_change_takes_effect_without_restart(stack: Stack) -> None:
    url = stack.g.url + "/v1/models"
    assert HTTP.get(url, headers=auth(FILE_A)).status_code == 200
    assert HTTP.get(url, headers=auth(FILE_B)).status_code == 401
    stack.key_file.write_text(f"- key: {FILE_B}\n  name: file-b\n")
    assert wait_for(lambda: HTTP.get(url, headers=auth(FILE_B)).status_code == 200, timeout=5)
    assert HTTP.get(url, headers=auth(FILE_A)).status_code == 401
    # A broken file is ignored: the keys in force stay.
    stack.key_file.write_text("- key: short\n")
    assert wait_for(lambda: stack.g.log().count("key_file_invalid") == 1, timeout=10)
    assert HTTP.get(url, headers=auth(FILE_B)).status_code == 200
    # So is an empty one (a file caught between its truncation and its writing).
    stack.key_file.write_text("")
    assert wait_for(lambda: stack.g.log().count("key_file_invalid") == 2, timeout=10)
    assert '"reason":"empty"' in stack.g.log()
    assert HTTP.get(url, headers=auth(FILE_B)).status_code == 200
    # So is a field given twice: YAML keeps the last, and `models: null` after
    # `models: [...]` gave the key every model (the settings file refuses it the same way).
    stack.key_file.write_text(f"- key: {FILE_A}\n  models: [{MODEL}]\n  models: null\n")
    assert wait_for(lambda: stack.g.log().count("key_file_invalid") == 3, timeout=10)
    assert '"reason":"key file ' in stack.g.log() and "given twice" in stack.g.log()
    assert HTTP.get(url, headers=auth(FILE_A)).status_code == 401
    assert HTTP.get(url, headers=auth(FILE_B)).status_code == 200
    # `api_keys: []` revokes every key on purpose.
    stack.key_file.write_text("api_keys: []\n")
    assert wait_for(lambda: HTTP.get(url, headers=auth(FILE_B)).status_code == 401, timeout=10)


@pytest.mark.slow
def test_key_file_rewritten_with_its_old_mtime_is_reloaded(stack: Stack) -> None:
    """Tools that keep a file's modification time (`cp -p`, `rsync -a`, a Nix store path
    behind a symlink, whose mtime is always 1) replaced a key with another of the same
    length and left the watcher's (mtime, size) unchanged: the revoked key stayed valid.
    The inode's change time cannot be set back, and a new file is a new inode."""
    url = stack.g.url + "/v1/models"
    ok = lambda key: HTTP.get(url, headers=auth(key)).status_code == 200  # noqa: E731
    stack.key_file.write_text(f"- key: {FILE_B}\n")
    assert wait_for(lambda: ok(FILE_B), timeout=5)
    stack.key_file.write_text(f"- key: {FILE_A}\n")
    assert wait_for(lambda: ok(FILE_A) and not ok(FILE_B), timeout=5)
    before = stack.key_file.stat()
    stack.key_file.write_text(f"- key: {FILE_B}\n")
    os.utime(stack.key_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = stack.key_file.stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert wait_for(lambda: ok(FILE_B), timeout=5)
    assert not ok(FILE_A)


# --- failover (kills an engine: keep after the tests that count both engines) ----------


@pytest.mark.slow
def test_refused_connection_fails_over_to_the_next_engine(stack: Stack) -> None:
    stack.victim.kill()
    with httpx.Client(base_url=stack.g.url, timeout=10) as client:
        codes = [_chat(client, user=f"u{i}").status_code for i in range(6)]
    assert codes == [200] * 6
    r = HTTP.get(stack.g.url + "/readyz")
    assert r.json()["healthy_engines"] == 1


# --- logs (last: reads what every test above logged) ----------------------------------


@pytest.mark.slow
def test_logs_carry_no_secrets(stack: Stack) -> None:
    with httpx.Client(base_url=stack.g.url, timeout=10) as client:
        content = [
            {"type": "text", "text": PROMPT_MARKER},
            {"type": "image_url", "image_url": {"url": DATA_URL}},
        ]
        _chat(client, messages=[{"role": "user", "content": content}])
        _chat(client, messages=[{"role": "user", "content": PROMPT_MARKER}])
        client.get("/v1/models", headers=auth(FULL + "-wrong"))
        client.post("/v1/load_lora_adapter", headers=auth(FULL), json={"lora_name": "x"})
    for proc in (stack.g, stack.p, stack.e):
        log = proc.log()
        assert '"event":"request"' in log
        for secret in (FULL, POOLING_ONLY, METRICS_ONLY, OTHER_MODEL, FILE_A, FILE_B, UPSTREAM,
                       PROMPT_MARKER, DATA_URL[:40], "SECRET"):  # fmt: skip
            assert secret not in log, secret
    # Refusals of blocked routes are logged with the key's name.
    lines = [json.loads(line) for line in stack.g.log().splitlines() if line.startswith("{")]
    blocked = [x for x in lines if x.get("code") == "endpoint_blocked" and x.get("key_name")]
    assert blocked and blocked[-1]["key_name"] == "key-1"
    assert {x["group"] for x in lines if x.get("event") == "request"} >= {
        g.value for g in (Group.inference, Group.models, Group.audio)
    }
