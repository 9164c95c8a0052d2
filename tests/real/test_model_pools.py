"""A chat engine and an embedding engine behind one gateway: each request reaches the
engine serving its model (by the engines' access logs and vLLM's own counters), and
`/v1/models` is the two engines' lists merged. The embedding engine runs for this module
only; it is stopped in the last test to see its model turn unavailable."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from bench.harness.metrics import HTTP
from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc, error_code, wait_for
from tests.real.conftest import Engines
from tests.real.harness import AUTH, KEY, Snapshot, chat_body, gateway, metric, post, received

pytestmark = pytest.mark.real_vllm


@dataclass
class Pair:
    chat: Engine
    embed: Engine
    gw: Proc


@pytest.fixture(scope="module")
def pair(real_engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    # The two side by side, and no other (the session's chat engine if it runs already).
    real_engines.warm("chat", "embed")
    chat, embed = real_engines.get("chat"), real_engines.get("embed")
    tmp = tmp_path_factory.mktemp("model-pools")
    try:
        # Checks every 0.5 s: the last test sees the embedding engine go within seconds.
        with gateway(tmp, [chat, embed], GATEWAY_ROUTING__HEALTH_INTERVAL="0.5") as gw:
            assert wait_for(lambda: HTTP.get(gw.url + "/readyz").json()["healthy_engines"] == 2)
            yield Pair(chat, embed, gw)
    finally:
        real_engines.stop("embed")


def test_chat_and_embeddings_each_reach_their_engine(pair: Pair) -> None:
    chat_seen, embed_seen = len(received(pair.chat)), len(received(pair.embed))
    chat_before = Snapshot.of(pair.chat)
    embed_before = metric(pair.embed, "vllm:request_success_total")
    with openai.OpenAI(base_url=pair.gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        for i in range(4):
            reply = client.chat.completions.create(
                model=pair.chat.name,
                messages=[{"role": "user", "content": f"Tell me about river {i}."}],
                max_tokens=2,
            )
            assert reply.model == pair.chat.name
            vectors = client.embeddings.create(model=pair.embed.name, input=[f"document {i}"])
            assert len(vectors.data[0].embedding) == 128
    # Each engine's access log: only its own model's route, every request answered 200
    # (the other engine would have answered 404, the model not being its own).
    assert received(pair.chat)[chat_seen:] == [("POST", "/v1/chat/completions", 200)] * 4
    assert received(pair.embed)[embed_seen:] == [("POST", "/v1/embeddings", 200)] * 4
    # vLLM's own counters agree.
    assert Snapshot.of(pair.chat).finished - chat_before.finished == 4
    assert metric(pair.embed, "vllm:request_success_total") - embed_before == 4


def test_the_model_list_is_both_engines_lists_merged(pair: Pair) -> None:
    direct = [
        HTTP.get(e.url + "/v1/models", timeout=10).json()["data"] for e in (pair.chat, pair.embed)
    ]
    r = HTTP.get(pair.gw.url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    listing = r.json()["data"]
    assert [m["id"] for m in listing] == [pair.chat.name, pair.embed.name]
    for mine, theirs in zip(listing, [d[0] for d in direct], strict=True):
        # vLLM 0.32 lists the model's path on its disk as `root`: never shown.
        assert theirs["root"] != theirs["id"] and mine["root"] == mine["id"]
        assert mine["max_model_len"] == theirs["max_model_len"]


def test_refusals_reach_no_engine(pair: Pair) -> None:
    seen = len(received(pair.chat)), len(received(pair.embed))
    url = pair.gw.url
    # The two engines' default models differ: a request must name its model.
    r = post(url + "/v1/embeddings", {"input": "a bird"})
    assert (r.status_code, error_code(r)) == (400, "model_required")
    r = post(url + "/v1/chat/completions", chat_body("not-served", "hello"))
    assert (r.status_code, error_code(r)) == (404, "model_not_found")
    assert r.json()["error"]["message"] == (
        "The model `not-served` does not exist or you do not have access to it."
    )
    assert (len(received(pair.chat)), len(received(pair.embed))) == seen


def test_a_stopped_engines_model_is_503_while_the_other_serves(
    pair: Pair, real_engines: Engines
) -> None:
    real_engines.stop("embed")
    assert wait_for(
        lambda: HTTP.get(pair.gw.url + "/readyz").json()["healthy_engines"] == 1, timeout=20
    )
    r = post(pair.gw.url + "/v1/embeddings", {"model": pair.embed.name, "input": "a bird"})
    assert (r.status_code, error_code(r)) == (503, "model_unavailable")
    assert "retry-after" in r.headers
    seen = len(received(pair.chat))
    r = post(pair.gw.url + "/v1/chat/completions", chat_body(pair.chat.name, "hello"))
    assert r.status_code == 200, r.text
    assert received(pair.chat)[seen:] == [("POST", "/v1/chat/completions", 200)]
    r = HTTP.get(pair.gw.url + "/v1/models", headers=AUTH, timeout=10)
    assert [m["id"] for m in r.json()["data"]] == [pair.chat.name]
