"""Pooling engines behind the gateway: embeddings (the OpenAI client), score, rerank,
classify and pooling (httpx), and their route lists. The two pooling engines run for this
module only, so that no more than four engines run at once."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc
from tests.real.conftest import Engines
from tests.real.harness import (
    KEY,
    POOLING_KEY,
    engine_routes,
    gateway,
    post,
    received,
    unclassified,
)

pytestmark = pytest.mark.real_vllm

POOLING_AUTH = {"Authorization": f"Bearer {POOLING_KEY}"}
DOCUMENTS = ["the red car on the road", "a bird in the tree", "the blue sea and the ship"]


@dataclass
class Pooling:
    embed: Engine
    rerank: Engine
    embed_gw: Proc
    rerank_gw: Proc


@pytest.fixture(scope="module")
def pooling(real_engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pooling]:
    real_engines.warm("embed", "rerank")
    embed, rerank = real_engines.get("embed"), real_engines.get("rerank")
    tmp = tmp_path_factory.mktemp("pooling")
    try:
        with gateway(tmp, [embed]) as embed_gw, gateway(tmp, [rerank]) as rerank_gw:
            yield Pooling(embed, rerank, embed_gw, rerank_gw)
    finally:
        real_engines.stop("embed", "rerank")


def test_openai_embeddings(pooling: Pooling) -> None:
    engine, seen = pooling.embed, len(received(pooling.embed))
    with openai.OpenAI(base_url=pooling.embed_gw.url + "/v1", api_key=KEY, max_retries=0) as c:
        out = c.embeddings.create(model=engine.name, input=DOCUMENTS)
    assert [d.index for d in out.data] == [0, 1, 2]
    for item in out.data:
        assert len(item.embedding) == 128
        # Mean pooling then normalisation (the model's sentence-transformers layout).
        assert math.isclose(math.fsum(x * x for x in item.embedding), 1.0, rel_tol=1e-4)
    assert out.usage.prompt_tokens > len(DOCUMENTS)
    assert received(engine)[seen:] == [("POST", "/v1/embeddings", 200)]


def test_score_and_pooling_on_the_embedding_model(pooling: Pooling) -> None:
    engine, url = pooling.embed, pooling.embed_gw.url
    score = post(url + "/v1/score", {"model": engine.name, "text_1": "a car",
                                     "text_2": DOCUMENTS}, POOLING_AUTH)  # fmt: skip
    assert score.status_code == 200, score.text
    assert [d["index"] for d in score.json()["data"]] == [0, 1, 2]
    assert all(-1.0 <= d["score"] <= 1.0 for d in score.json()["data"])
    pooled = post(url + "/pooling", {"model": engine.name, "input": "a bird"}, POOLING_AUTH)
    assert pooled.status_code == 200, pooled.text
    assert len(pooled.json()["data"][0]["data"]) == 128


def test_rerank_and_classify_on_the_cross_encoder(pooling: Pooling) -> None:
    engine, url = pooling.rerank, pooling.rerank_gw.url
    seen = len(received(engine))
    body = {"model": engine.name, "query": "a red car", "documents": DOCUMENTS}
    ranked = post(url + "/rerank", body, POOLING_AUTH)
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    v1 = post(url + "/v1/rerank", {**body, "top_n": 2}, POOLING_AUTH)
    assert len(v1.json()["results"]) == 2
    classified = post(url + "/classify", {"model": engine.name, "input": DOCUMENTS[:2]},
                      POOLING_AUTH)  # fmt: skip
    assert classified.status_code == 200, classified.text
    assert [len(d["probs"]) for d in classified.json()["data"]] == [1, 1]
    assert received(engine)[seen:] == [
        ("POST", "/rerank", 200),
        ("POST", "/v1/rerank", 200),
        ("POST", "/classify", 200),
    ]


def test_pooling_engine_routes_are_all_classified(pooling: Pooling) -> None:
    for engine in (pooling.embed, pooling.rerank):
        assert "/score" in engine_routes(engine)
        assert unclassified(engine) == [], engine.name
