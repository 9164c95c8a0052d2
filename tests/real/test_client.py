"""vLLM's own benchmark client through the gateway in front of the real engine: `vllm bench
serve` of vLLM 0.32 (bench/suites/bench_serve.py, the `client` suite's runs), its key in
$OPENAI_API_KEY as vLLM's client gives it, text and new random images as data: URLs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness.realvllm.home import Home
from bench.harness.realvllm.launcher import Engine
from bench.suites.bench_serve import TEXT, BenchServe, Workload, images
from tests.procs import Proc
from tests.real.harness import KEY, gateway, received

pytestmark = pytest.mark.real_vllm

PROMPTS = 3


@pytest.fixture(scope="module")
def front(
    real_multimodal_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    with gateway(tmp_path_factory.mktemp("client-gw"), [real_multimodal_engine]) as proc:
        yield proc


def client(home: Home, engine: Engine, tmp_path: Path) -> BenchServe:
    return BenchServe(home.python, engine.name, str(engine.model_path), tmp_path, PROMPTS, 2)


@pytest.mark.parametrize("workload", [TEXT, images(448)], ids=lambda w: w.name)
def test_every_request_of_vllms_client_is_answered_through_the_gateway(
    real_home: Home,
    real_multimodal_engine: Engine,
    front: Proc,
    tmp_path: Path,
    workload: Workload,
) -> None:
    before = received(real_multimodal_engine).count(("POST", "/v1/chat/completions", 200))
    outcome = client(real_home, real_multimodal_engine, tmp_path).run(
        "gateway", front.url, KEY, workload, seed=11
    )
    assert (outcome.completed, outcome.failed, outcome.errors) == (PROMPTS, 0, ())
    assert outcome.ttft_p50_ms > 0 and outcome.tpot_p50_ms > 0 and outcome.throughput > 0
    after = received(real_multimodal_engine).count(("POST", "/v1/chat/completions", 200))
    assert after - before == PROMPTS


def test_a_key_the_gateway_does_not_know_fails_every_request(
    real_home: Home, real_multimodal_engine: Engine, front: Proc, tmp_path: Path
) -> None:
    before = received(real_multimodal_engine)
    outcome = client(real_home, real_multimodal_engine, tmp_path).run(
        "unknown-key", front.url, "sk-not-a-key-0123456789", TEXT, seed=12
    )
    assert (outcome.completed, outcome.failed, outcome.errors) == (0, PROMPTS, ("Unauthorized",))
    assert received(real_multimodal_engine) == before
