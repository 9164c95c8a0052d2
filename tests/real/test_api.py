"""The gateway in front of real engines: the OpenAI client and plain HTTP on every API the
tier's engines serve, each with the engine's own evidence that it served the request."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from bench.harness.metrics import HTTP
from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc, RecordingServer, Route
from tests.real.harness import AUTH, KEY, Snapshot, chat_body, gateway, image_part, post, received
from tests.unit.media.test_samples import data_url, png

pytestmark = pytest.mark.real_vllm

PNG = png(128, 96, (20, 120, 220))


@pytest.fixture(scope="module")
def chat_gw(tmp_path_factory: pytest.TempPathFactory, real_chat_engine: Engine) -> Iterator[Proc]:
    with gateway(tmp_path_factory.mktemp("api-chat"), [real_chat_engine]) as proc:
        yield proc


@pytest.fixture(scope="module")
def origin() -> Iterator[RecordingServer]:
    routes = {"/img.png": Route(body=PNG, headers={"Content-Type": "image/png"})}
    with RecordingServer(routes) as server:
        yield server


@pytest.fixture(scope="module")
def mm_gw(
    tmp_path_factory: pytest.TempPathFactory,
    real_multimodal_engine: Engine,
    origin: RecordingServer,
) -> Iterator[Proc]:
    media = {
        "GATEWAY_MEDIA__ALLOWED_DOMAINS": f'["127.0.0.1:{origin.port}"]',
        "GATEWAY_MEDIA__ALLOWED_SCHEMES": '["http"]',
        "GATEWAY_MEDIA__ALLOWED_NETWORKS": '["127.0.0.0/8"]',
    }
    with gateway(tmp_path_factory.mktemp("api-mm"), [real_multimodal_engine], **media) as proc:
        yield proc


def served(engine: Engine, since: int) -> list[tuple[str, str, int]]:
    return received(engine)[since:]


def test_openai_chat_plain_and_streamed(chat_gw: Proc, real_chat_engine: Engine) -> None:
    engine = real_chat_engine
    before, seen = Snapshot.of(engine), len(received(engine))
    messages = [{"role": "user", "content": "Tell me about the river and the city."}]
    with openai.OpenAI(base_url=chat_gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        plain = client.chat.completions.create(model=engine.name, messages=messages, max_tokens=6)
        chunks = list(
            client.chat.completions.create(
                model=engine.name,
                messages=messages,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert [m.id for m in client.models.list()] == [engine.name]
    assert plain.model == engine.name
    assert plain.choices[0].finish_reason in ("length", "stop")
    assert plain.usage is not None and 1 <= plain.usage.completion_tokens <= 6
    # Streamed: deltas, then a final chunk with the usage and no choices.
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    # The engine's own evidence: two chat requests served, their prompts counted.
    assert served(engine, seen) == [("POST", "/v1/chat/completions", 200)] * 2
    after = Snapshot.of(engine)
    assert after.finished == before.finished + 2
    assert after.prompt_tokens == before.prompt_tokens + 2 * plain.usage.prompt_tokens


def test_openai_completions(chat_gw: Proc, real_chat_engine: Engine) -> None:
    engine = real_chat_engine
    seen = len(received(engine))
    with openai.OpenAI(base_url=chat_gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        out = client.completions.create(
            model=engine.name, prompt="The garden and the house", max_tokens=5, logprobs=1
        )
    assert out.object == "text_completion"
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert out.choices[0].logprobs is not None
    assert served(engine, seen) == [("POST", "/v1/completions", 200)]


def test_tokenize_and_detokenize(chat_gw: Proc, real_chat_engine: Engine) -> None:
    engine = real_chat_engine
    body = {"model": engine.name, "prompt": "The blue train and the red car"}
    via_gateway = post(chat_gw.url + "/tokenize", body)
    direct = HTTP.post(engine.url + "/tokenize", json=body, timeout=30)
    assert via_gateway.status_code == 200
    assert via_gateway.json() == direct.json()
    tokens = via_gateway.json()["tokens"]
    assert via_gateway.json()["count"] == len(tokens) > 3
    back = post(chat_gw.url + "/detokenize", {"model": engine.name, "tokens": tokens})
    assert back.status_code == 200
    assert back.json()["prompt"].endswith("The blue train and the red car")


def _image_prompt_tokens(gw: Proc, engine: Engine, url: str | None) -> httpx.Response:
    content: list[dict[str, object]] = [{"type": "text", "text": "What is in the picture?"}]
    if url is not None:
        content.insert(0, image_part(url))
    return post(gw.url + "/v1/chat/completions", chat_body(engine.name, content))


def test_images_as_data_url_and_fetched_by_the_gateway(
    mm_gw: Proc, real_multimodal_engine: Engine, origin: RecordingServer
) -> None:
    engine = real_multimodal_engine
    text_only = _image_prompt_tokens(mm_gw, engine, None)
    inline = _image_prompt_tokens(mm_gw, engine, data_url("image/png", PNG))
    hits = len(origin.hits)
    fetched = _image_prompt_tokens(mm_gw, engine, f"{origin.url}/img.png")
    for r in (text_only, inline, fetched):
        assert r.status_code == 200, r.text
    # 128x96 pixels resize to 140x84: 10x6 patches, merged 2x2 into 15 image tokens,
    # plus the vision start and end markers (tiny-qwen2vl's processor).
    n = text_only.json()["usage"]["prompt_tokens"]
    assert inline.json()["usage"]["prompt_tokens"] == n + 15 + 2
    assert fetched.json()["usage"]["prompt_tokens"] == n + 15 + 2
    # The gateway fetched the image once; the engine got bytes, not the URL.
    assert len(origin.hits) == hits + 1
    assert not origin.hits[-1].headers.get("User-Agent", "").startswith("vLLM")


def test_engine_metrics_and_model_list_through_the_gateway(
    chat_gw: Proc, real_chat_engine: Engine
) -> None:
    models = HTTP.get(chat_gw.url + "/v1/models", headers=AUTH, timeout=10)
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [real_chat_engine.name]
    # The engine's version is for `admin` keys only, like the gateway's own.
    version = HTTP.get(chat_gw.url + "/version", headers=AUTH, timeout=10)
    assert (version.status_code, version.json()["error"]["code"]) == (403, "scope_not_allowed")
