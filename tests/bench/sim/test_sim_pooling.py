"""The simulated engine's pooling runner: embeddings, pooling, classify, score, rerank."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.procs import Proc, running, sim_proc

MODEL = "Qwen/Qwen3-Embedding-0.6B"
DOCS = [
    "Paris is the capital of France.",
    "Bananas are rich in potassium.",
    "The capital of Germany is Berlin.",
]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("pool")
    proc = sim_proc(tmp, "--runner", "pooling", "--model", MODEL, "--latency", "zero")
    with running(proc):
        yield proc


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_openai_client_embeddings(sim: Proc) -> None:
    with openai.OpenAI(base_url=sim.url + "/v1", api_key="unused") as oc:
        # The client asks for base64 by default and decodes it itself.
        result = oc.embeddings.create(model=MODEL, input=["cats and dogs", "cats and dogs!", "tax"])
        floats = oc.embeddings.create(model=MODEL, input="cats", encoding_format="float")
    vectors = [d.embedding for d in result.data]
    assert [len(v) for v in vectors] == [1024] * 3
    assert abs(dot(vectors[0], vectors[0]) - 1.0) < 1e-4
    assert dot(vectors[0], vectors[1]) > dot(vectors[0], vectors[2])
    assert result.usage.prompt_tokens > 0
    assert len(floats.data[0].embedding) == 1024


@pytest.mark.slow
def test_embeddings_wire_format_and_dimensions(client: httpx.Client) -> None:
    body = client.post("/v1/embeddings", json={"input": "same text", "dimensions": 64}).json()
    assert body["object"] == "list" and body["id"].startswith("embd-") and body["model"] == MODEL
    item = body["data"][0]
    assert (item["index"], item["object"], len(item["embedding"])) == (0, "embedding", 64)
    again = client.post("/v1/embeddings", json={"input": "same text", "dimensions": 64}).json()
    assert again["data"][0]["embedding"] == item["embedding"]
    chat = client.post("/v1/embeddings", json={"messages": [{"role": "user", "content": "hi"}]})
    assert len(chat.json()["data"]) == 1


@pytest.mark.slow
def test_pooling_and_classify(client: httpx.Client) -> None:
    pooled = client.post("/pooling", json={"input": ["a", "b"]}).json()
    assert pooled["object"] == "list"
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    classified = client.post("/classify", json={"input": "great product"}).json()
    item = classified["data"][0]
    assert item["label"] in ("LABEL_0", "LABEL_1") and item["num_classes"] == 2
    assert abs(sum(item["probs"]) - 1.0) < 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize(("left", "right"), [("queries", "documents"), ("text_1", "text_2")])
def test_score_routes(client: httpx.Client, path: str, left: str, right: str) -> None:
    body = client.post(path, json={left: "capital of France", right: DOCS}).json()
    assert body["object"] == "list"
    scores = [d["score"] for d in body["data"]]
    assert [d["object"] for d in body["data"]] == ["score"] * 3
    assert scores[0] == max(scores) and scores[0] > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_puts_the_matching_document_first(client: httpx.Client, path: str) -> None:
    body = client.post(path, json={"query": "What is the capital of Germany?",
                                   "documents": DOCS, "top_n": 2}).json()  # fmt: skip
    results = body["results"]
    assert len(results) == 2
    assert results[0]["index"] == 2 and results[0]["document"]["text"] == DOCS[2]
    assert results[0]["relevance_score"] > results[1]["relevance_score"]
    assert body["usage"]["total_tokens"] > 0


@pytest.mark.slow
def test_invocations_dispatch_pooling(client: httpx.Client) -> None:
    assert client.post("/invocations", json={"input": "x"}).json()["data"][0]["object"] == (
        "embedding"
    )
    rerank = client.post("/invocations", json={"query": "Paris", "documents": DOCS}).json()
    assert rerank["results"][0]["index"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/embeddings", {}, 400),
        ("/v1/embeddings", {"input": 3}, 400),
        ("/v1/embeddings", {"input": "x", "dimensions": 0}, 400),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 400),
        ("/v1/embeddings", {"input": "x", "model": "other"}, 404),
        ("/score", {"queries": "x"}, 400),
        ("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, 400),
        ("/rerank", {"query": "x", "documents": [1]}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 404),
    ],
)
def test_pooling_errors(
    client: httpx.Client, path: str, body: dict[str, object], status: int
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status
