"""Tenants and vLLM's multimodal caches, on the real engine (tiny Qwen2-VL), read from its
own counters.

vLLM 0.32 keys its multimodal processor cache (and the encoder cache and the media blocks
of the prefix cache, which share the key) on a part's `uuid` when it has one, else on a
hash of the model and the item's bytes (`multimodal/processing/inputs.py`). It exports
the processor cache's lookups as `vllm:mm_cache_queries` and `vllm:mm_cache_hits`, in
items (`v1/metrics/loggers.py`). With `payload.cache_isolation: tenant` the gateway gives
each item it inlines a uuid in the tenant's namespace: the same tenant hits, another
tenant misses. Without isolation another tenant hits: that is the check that the
isolated cases can fail.

The prefix cache is no witness here: with isolation the gateway also sets a per-tenant
`cache_salt`, which splits the prefix cache whatever the uuid.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.realvllm.launcher import Engine
from bench.harness.samples import data_url, png
from tests.procs import Proc, RecordingServer, Route, scrape, total, wait_for
from tests.real.harness import gateway, image_part, received

pytestmark = pytest.mark.real_vllm

KEYS = {"a1": "sk-real-a1-0123456789abcdef", "a2": "sk-real-a2-0123456789abcdef",
        "b1": "sk-real-b1-0123456789abcdef"}  # fmt: skip
TENANTS = {"a1": "team-a", "a2": "team-a", "b1": "team-b"}
# One image per case, so no case finds what another one left in the engine's caches.
IMAGES = {f"/{n}.png": png(64, 64, (n * 25, 60, 120)) for n in range(1, 5)}


@dataclass
class Stack:
    engine: Engine
    shared: Proc  # cache_isolation off (the default)
    isolated: Proc  # cache_isolation tenant
    origin: RecordingServer
    http: httpx.Client

    def part(self, path: str, form: str) -> dict[str, Any]:
        if form == "remote":
            return image_part(self.origin.url + path)
        return image_part(data_url("image/png", IMAGES[path]))

    def counters(self) -> tuple[float, float]:
        samples = scrape(self.engine.url + "/metrics")
        return (total(samples, "vllm:mm_cache_queries_total"),
                total(samples, "vllm:mm_cache_hits_total"))  # fmt: skip

    def hits(self, gateway: Proc, name: str, part: dict[str, Any]) -> float:
        """Send one image as `name` through `gateway`: the engine's multimodal cache hits
        it caused (0: a miss, 1: a hit)."""
        queries, hits = self.counters()
        content = [part, {"type": "text", "text": "What is it?"}]
        body = {
            "model": self.engine.name,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1,
        }
        headers = {"Authorization": f"Bearer {KEYS[name]}"}
        r = self.http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        # The engine records a request's cache lookups with its outputs: wait for them.
        assert wait_for(lambda: self.counters()[0] > queries, 10)
        after_queries, after_hits = self.counters()
        assert after_queries == queries + 1  # one image, one lookup
        return after_hits - hits


def _keys() -> str:
    return json.dumps([{"key": k, "name": n, "tenant": TENANTS[n]} for n, k in KEYS.items()])


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, real_multimodal_engine: Engine
) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("media-isolation-real")
    routes = {p: Route(body=b, headers={"Content-Type": "image/png"}) for p, b in IMAGES.items()}
    with RecordingServer(routes) as origin:
        env = {
            "GATEWAY_API_KEYS": _keys(),
            "GATEWAY_PAYLOAD__NAMESPACE_SECRET": "media-isolation-real-secret",
            "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps([f"127.0.0.1:{origin.port}"]),
            "GATEWAY_MEDIA__ALLOWED_SCHEMES": '["http"]',
            "GATEWAY_MEDIA__ALLOWED_NETWORKS": '["127.0.0.0/8"]',
        }
        engines = [real_multimodal_engine]
        with (
            gateway(tmp, engines, **env) as shared,
            gateway(tmp, engines, **env, GATEWAY_PAYLOAD__CACHE_ISOLATION="tenant") as isolated,
            httpx.Client(timeout=60) as http,
        ):
            yield Stack(real_multimodal_engine, shared, isolated, origin, http)


@pytest.mark.parametrize(("form", "path"), [("remote", "/1.png"), ("inline", "/2.png")])
def test_without_isolation_another_tenant_hits_the_engines_multimodal_cache(
    stack: Stack, form: str, path: str
) -> None:
    part = stack.part(path, form)
    assert stack.hits(stack.shared, "a1", part) == 0  # first sight of this image
    assert stack.hits(stack.shared, "b1", part) == 1  # what team-a's request left


@pytest.mark.parametrize(("form", "path"), [("remote", "/3.png"), ("inline", "/4.png")])
def test_with_isolation_another_tenant_misses_the_engines_multimodal_cache(
    stack: Stack, form: str, path: str
) -> None:
    part = stack.part(path, form)
    before = len(received(stack.engine))
    assert stack.hits(stack.isolated, "a1", part) == 0  # first sight
    assert stack.hits(stack.isolated, "a1", part) == 1  # the same key again
    assert stack.hits(stack.isolated, "b1", part) == 0  # another tenant: nothing for it
    assert stack.hits(stack.isolated, "a2", part) == 1  # the same tenant's other key
    assert stack.hits(stack.isolated, "b1", part) == 1  # team-b's own entry now
    assert len(received(stack.engine)) == before + 5
