"""Media caches under `payload.cache_isolation`: another tenant's image is a miss in the
gateway's media cache and in the engine's multimodal cache, through the gateway under
uvicorn in front of a simulated engine (which keys its multimodal cache like vLLM 0.32:
on a part's `uuid` when it has one, else on the bytes) and a loopback media origin.

Without isolation (the default) both caches are shared: the first tests show the hit
that isolation takes away, so the isolated ones cannot pass for want of a cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import scrape, total
from bench.harness.samples import data_url, png
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import Proc, RecordingServer, Route, gateway_proc, running, sim_proc, wait_for

KEYS = {"a1": "key-a1-0123456789abcdef", "a2": "key-a2-0123456789abcdef",
        "b1": "key-b1-0123456789abcdef"}  # fmt: skip
TENANTS = {"a1": "team-a", "a2": "team-a", "b1": "team-b"}
# One image per test, so no test finds what another one cached.
IMAGES = {f"/{n}.png": png(64, 64, (n * 20, 40, 90)) for n in range(1, 9)}


@dataclass
class Stack:
    sim: Proc
    shared: Proc  # cache_isolation off (the default)
    isolated: Proc  # cache_isolation tenant
    origin: RecordingServer
    http: httpx.Client

    def ask(self, gateway: Proc, name: str, part: dict[str, Any]) -> httpx.Response:
        content = [part, {"type": "text", "text": "What is it?"}]
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
        headers = {"Authorization": f"Bearer {KEYS[name]}"}
        return self.http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.origin.port}{path}"

    def fetches(self, path: str) -> int:
        return sum(1 for h in self.origin.hits if h.path == path)

    def mm_hits(self) -> float:
        return total(scrape(self.sim.url + "/metrics"), "vllm:mm_cache_hits_total")

    def received_parts(self) -> list[dict[str, Any]]:
        got = self.http.get(self.sim.url + "/sim/requests").json()
        bodies = [json.loads(r["body"]) for r in got if r["method"] == "POST"]
        return [b["messages"][0]["content"][0] for b in bodies]


def _env(sim: Proc, origin: RecordingServer, **extra: str) -> dict[str, str]:
    keys = [{"key": k, "name": n, "tenant": TENANTS[n]} for n, k in KEYS.items()]
    return {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": "media-isolation-test-secret",
        "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps([f"127.0.0.1:{origin.port}"]),
        "GATEWAY_MEDIA__ALLOWED_SCHEMES": json.dumps(["http"]),
        "GATEWAY_MEDIA__ALLOWED_NETWORKS": json.dumps(["127.0.0.0/8"]),
        **extra,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("media-isolation")
    routes = {p: Route(body=b, headers={"Content-Type": "image/png"}) for p, b in IMAGES.items()}
    sim = sim_proc(tmp, "--record-requests", "100", "--latency", "zero")
    with RecordingServer(routes) as origin, running(sim):
        shared = gateway_proc(tmp, _env(sim, origin))
        isolated = gateway_proc(tmp, _env(sim, origin, GATEWAY_PAYLOAD__CACHE_ISOLATION="tenant"))
        with running(shared, isolated, ready_path="/healthz"), httpx.Client(timeout=20) as http:
            for gateway in (shared, isolated):
                assert wait_for(lambda g=gateway: http.get(g.url + "/readyz").status_code == 200)
            yield Stack(sim, shared, isolated, origin, http)


def by_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.slow
def test_without_isolation_tenants_share_the_media_caches(stack: Stack) -> None:
    url = stack.url("/1.png")
    assert stack.ask(stack.shared, "a1", by_url(url)).status_code == 200
    hits = stack.mm_hits()
    assert stack.ask(stack.shared, "b1", by_url(url)).status_code == 200
    assert stack.fetches("/1.png") == 1  # b1's request was served from the gateway's cache
    assert stack.mm_hits() == hits + 1  # and hit what a1's request left in the engine's


@pytest.mark.slow
def test_another_tenants_remote_image_is_fetched_again(stack: Stack) -> None:
    url = stack.url("/2.png")
    assert stack.ask(stack.isolated, "a1", by_url(url)).status_code == 200
    assert stack.ask(stack.isolated, "b1", by_url(url)).status_code == 200
    assert stack.fetches("/2.png") == 2  # a miss for team-b
    assert stack.ask(stack.isolated, "a2", by_url(url)).status_code == 200
    assert stack.fetches("/2.png") == 2  # a hit for team-a's other key


@pytest.mark.slow
@pytest.mark.parametrize("form", ["remote", "inline"])
def test_another_tenants_image_misses_the_engines_multimodal_cache(stack: Stack, form: str) -> None:
    path = "/3.png" if form == "remote" else "/4.png"
    part = by_url(stack.url(path) if form == "remote" else data_url("image/png", IMAGES[path]))
    stack.http.delete(stack.sim.url + "/sim/requests")
    assert stack.ask(stack.isolated, "a1", part).status_code == 200
    hits = stack.mm_hits()
    assert stack.ask(stack.isolated, "b1", part).status_code == 200
    assert stack.mm_hits() == hits  # another tenant: nothing cached for it
    assert stack.ask(stack.isolated, "a2", part).status_code == 200
    assert stack.mm_hits() == hits + 1  # the same tenant shares
    uuids = [p["uuid"] for p in stack.received_parts()]
    assert uuids[0] == uuids[2] != uuids[1]
    assert all(u.startswith("gw-") for u in uuids)


@pytest.mark.slow
def test_a_uuid_of_the_clients_own_is_kept_namespaced(stack: Stack) -> None:
    """A part that names its own uuid keeps it (namespaced per key), not the gateway's."""
    part = {**by_url(stack.url("/5.png")), "uuid": "my-picture"}
    stack.http.delete(stack.sim.url + "/sim/requests")
    assert stack.ask(stack.isolated, "a1", part).status_code == 200
    assert stack.ask(stack.isolated, "a2", part).status_code == 200
    first, second = (p["uuid"] for p in stack.received_parts())
    assert first != second and "my-picture" not in first + second
