"""Media the engine cannot be given a per-tenant name for, under `payload.cache_isolation`:
refused with 400 `media_not_isolated` before anything is fetched and before the engine,
through the gateway under uvicorn in front of a simulated engine (which keys its
multimodal cache like vLLM 0.32: on a part's `uuid`, else on the bytes) and a loopback
media origin that records every fetch.

Each refused request is sent to a gateway without isolation too, where it passes: the
refusal is isolation's, not another rule's. Parts vLLM reads alike with a uuid (a part
without a type, in a list) are named instead, and another tenant misses."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import scrape, total
from bench.harness.samples import data_url, png, wav
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    RecordingServer,
    Route,
    auth,
    error_code,
    gateway_proc,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

KEYS = {"a1": "key-a1-0123456789abcdef", "a2": "key-a2-0123456789abcdef",
        "b1": "key-b1-0123456789abcdef"}  # fmt: skip
TENANTS = {"a1": "team-a", "a2": "team-a", "b1": "team-b"}
IMAGES = {f"/{n}.png": png(48, 48, (n * 25, 90, 40)) for n in range(1, 9)}
WAV = data_url("audio/wav", wav(1600))


@dataclass
class Stack:
    sim: Proc
    shared: Proc  # inline, cache_isolation off
    isolated: Proc  # inline, cache_isolation tenant
    pass_shared: Proc  # passthrough, off
    pass_isolated: Proc  # passthrough, tenant
    origin: RecordingServer
    http: httpx.Client

    def post(
        self, gateway: Proc, path: str, body: dict[str, Any], key: str = "a1"
    ) -> httpx.Response:
        return self.http.post(gateway.url + path, json=body, headers=auth(KEYS[key]))

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.origin.port}{path}"

    def received(self) -> list[dict[str, Any]]:
        got = self.http.get(self.sim.url + "/sim/requests").json()
        return [json.loads(r["body"]) for r in got if r["method"] == "POST"]

    def mm_hits(self) -> float:
        return total(scrape(self.sim.url + "/metrics"), "vllm:mm_cache_hits_total")


def _env(sim: Proc, origin: RecordingServer, **extra: str) -> dict[str, str]:
    keys = [{"key": k, "name": n, "tenant": TENANTS[n]} for n, k in KEYS.items()]
    return {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": "media-isolation-gaps-secret",
        "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps([f"127.0.0.1:{origin.port}"]),
        "GATEWAY_MEDIA__ALLOWED_SCHEMES": json.dumps(["http"]),
        "GATEWAY_MEDIA__ALLOWED_NETWORKS": json.dumps(["127.0.0.0/8"]),
        **extra,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("media-isolation-gaps")
    routes = {p: Route(body=b, headers={"Content-Type": "image/png"}) for p, b in IMAGES.items()}
    # In passthrough without isolation the engine fetches from the origin itself.
    sim = sim_proc(tmp, "--record-requests", "100", "--latency", "zero")
    tenant = {"GATEWAY_PAYLOAD__CACHE_ISOLATION": "tenant"}
    passthrough = {"GATEWAY_MEDIA__MODE": "passthrough"}
    with RecordingServer(routes) as origin, running(sim):
        gateways = [
            gateway_proc(tmp, _env(sim, origin)),
            gateway_proc(tmp, _env(sim, origin, **tenant)),
            gateway_proc(tmp, _env(sim, origin, **passthrough)),
            gateway_proc(tmp, _env(sim, origin, **passthrough, **tenant)),
        ]
        with running(*gateways, ready_path="/healthz"), httpx.Client(timeout=20) as http:
            for gateway in gateways:
                assert wait_for(lambda g=gateway: http.get(g.url + "/readyz").status_code == 200)
            yield Stack(sim, *gateways, origin, http)


def _decision(**media: list[str]) -> dict[str, Any]:
    question = {
        "type": "noul",
        "instructions": "Is there a cat?",
        "criteria": {"true": "a cat is in the photo", "false": "no cat"},
    }
    return {"model": MODEL, "state": "a photo", "questions": {"q1": question}, **media}


def _anthropic(*blocks: dict[str, Any]) -> dict[str, Any]:
    content = [*blocks, {"type": "text", "text": "What is it?"}]
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def _chat(part: dict[str, Any]) -> dict[str, Any]:
    content = [part, {"type": "text", "text": "What is it?"}]
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def _url_block(url: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "url", "url": url}}


def _base64_block(image: bytes) -> dict[str, Any]:
    data = base64.b64encode(image).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


# (label, route, body for the origin's URL `u`, the refused item's path)
PLACES: list[tuple[str, str, Any, str]] = [
    ("messages url block", "/v1/messages", lambda u: _anthropic(_url_block(u)),
     "messages[0].content[0].source.url"),
    ("messages base64 block", "/v1/messages", lambda u: _anthropic(_base64_block(IMAGES["/8.png"])),
     "messages[0].content[0].source"),
    ("messages tool_result image", "/v1/messages",
     lambda u: _anthropic({"type": "tool_result", "tool_use_id": "t1", "content": [_url_block(u)]}),
     "messages[0].content[0].content[0].source.url"),
    ("systemone images", "/v1/systemone", lambda u: _decision(images=[u]), "images[0]"),
    ("systemone audio", "/v1/systemone", lambda u: _decision(audio=[WAV]), "audio[0]"),
    ("part with two media keys", "/v1/chat/completions",
     lambda u: _chat({"type": "image_url", "image_url": {"url": u}, "audio_url": {"url": WAV}}),
     "messages[0].content[0].image_url.url"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("label", "route", "body", "param"), PLACES, ids=[p[0] for p in PLACES])
def test_media_the_engine_reads_without_a_uuid_is_refused(
    stack: Stack, label: str, route: str, body: Any, param: str
) -> None:
    url = stack.url("/1.png")
    fetches, engine = len(stack.origin.hits), sim_received(stack.sim.url)
    r = stack.post(stack.isolated, route, body(url))
    assert r.status_code == 400, r.text
    assert error_code(r) == "media_not_isolated"
    error = r.json()["error"]
    assert error["param"] == param
    assert "tenants" in error["message"] and url not in error["message"]
    assert len(stack.origin.hits) == fetches  # nothing fetched
    assert sim_received(stack.sim.url) == engine  # nothing reached the engine
    # The same request without isolation passes.
    shared = stack.post(stack.shared, route, body(url))
    assert shared.status_code == 200, shared.text


@pytest.mark.slow
def test_a_remote_url_in_passthrough_is_refused(stack: Stack) -> None:
    """The engine would fetch the URL itself: the gateway never holds the bytes to name."""
    url = stack.url("/2.png")
    body = _chat({"type": "image_url", "image_url": {"url": url}})
    fetches, engine = len(stack.origin.hits), sim_received(stack.sim.url)
    r = stack.post(stack.pass_isolated, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert error_code(r) == "media_not_isolated"
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    assert "data: URL" in r.json()["error"]["message"]
    assert len(stack.origin.hits) == fetches
    assert sim_received(stack.sim.url) == engine
    # Without isolation the engine gets the URL and fetches it.
    stack.http.delete(stack.sim.url + "/sim/requests")
    assert stack.post(stack.pass_shared, "/v1/chat/completions", body).status_code == 200
    (got,) = stack.received()
    assert got["messages"][0]["content"][0]["image_url"]["url"] == url
    assert len(stack.origin.hits) == fetches + 1


@pytest.mark.slow
def test_passthrough_names_what_it_holds_or_the_client_names(stack: Stack) -> None:
    """In passthrough a data: URL is validated here, so it is named per tenant; a remote
    URL with the client's own uuid is named by that uuid (namespaced per key)."""
    stack.http.delete(stack.sim.url + "/sim/requests")
    inline = _chat(
        {"type": "image_url", "image_url": {"url": data_url("image/png", IMAGES["/3.png"])}}
    )
    named = _chat({"type": "image_url", "image_url": {"url": stack.url("/4.png")}, "uuid": "mine"})
    for body in (inline, named):
        r = stack.post(stack.pass_isolated, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
    first, second = (b["messages"][0]["content"][0]["uuid"] for b in stack.received())
    assert first.startswith("gw-") and second.startswith("gw-") and "mine" not in second


@pytest.mark.slow
@pytest.mark.parametrize("form", ["remote", "inline"])
def test_a_part_without_a_type_is_named_per_tenant(stack: Stack, form: str) -> None:
    """vLLM reads an untyped part by its media key, with or without a uuid: the gateway
    names it, so another tenant misses the engine's multimodal cache."""
    path = "/5.png" if form == "remote" else "/6.png"
    ref = stack.url(path) if form == "remote" else data_url("image/png", IMAGES[path])
    body = _chat({"image_url": {"url": ref}})
    stack.http.delete(stack.sim.url + "/sim/requests")
    assert stack.post(stack.isolated, "/v1/chat/completions", body, "a1").status_code == 200
    hits = stack.mm_hits()
    assert stack.post(stack.isolated, "/v1/chat/completions", body, "b1").status_code == 200
    assert stack.mm_hits() == hits  # another tenant: nothing cached for it
    assert stack.post(stack.isolated, "/v1/chat/completions", body, "a2").status_code == 200
    assert stack.mm_hits() == hits + 1  # the same tenant shares
    uuids = [b["messages"][0]["content"][0].get("uuid") for b in stack.received()]
    assert uuids[0] == uuids[2] != uuids[1]
    assert all(u is not None and u.startswith("gw-") for u in uuids)
