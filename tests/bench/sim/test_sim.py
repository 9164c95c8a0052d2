"""The simulated engine's generation runner, against a real server on loopback."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from bench.harness.metrics import HTTP
from bench.sim.responses import PATH as RESPONSES
from tests.procs import Proc, metric, running, scrape, sim_proc

MODEL = "Qwen/Qwen3-VL-2B-Instruct"
SYSTEM = "You are a careful assistant. " * 8  # several blocks of shared prefix
RETRIEVE = RESPONSES + "/{response_id}"


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("sim")
    proc = sim_proc(
        tmp, "--latency", "zero", "--record-requests", "50", "--enable-runtime-lora",
        "--max-model-len", "4096",
    )  # fmt: skip
    with running(proc):
        yield proc


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = sim_proc(tmp_path_factory.mktemp("guarded"), "--latency", "zero", "--api-key", "k3y")
    with running(proc):
        yield proc


def chat_body(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **extra,
    }


def sse(text: str) -> list[Any]:
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    return [orjson.loads(f[6:]) for f in frames[:-1]]


# --- info routes ----------------------------------------------------------------------


@pytest.mark.slow
def test_health_and_info_routes(client: httpx.Client) -> None:
    health = client.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200
    assert client.get("/version").json() == {"version": "0.33.0"}
    assert client.get("/load").json() == {"server_load": 0}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        MODEL, "model", "vllm", 4096,
    )  # fmt: skip


# --- chat and completions wire format ---------------------------------------------------


@pytest.mark.slow
def test_chat_non_streaming_wire_format(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json=chat_body("wire?", max_tokens=4))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


@pytest.mark.slow
def test_chat_streaming_frames_and_usage_chunk(client: httpx.Client) -> None:
    body = chat_body("stream?", max_tokens=3, stream=True, stream_options={"include_usage": True})
    r = client.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 3
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3

    plain = sse(client.post("/v1/chat/completions", json={**body, "stream_options": None}).text)
    assert all("usage" not in c for c in plain)


@pytest.mark.slow
def test_completions_wire_format(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    stream = {"prompt": "Once", "max_tokens": 2, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = sse(client.post("/v1/completions", json=stream).text)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert chunks[-1]["usage"]["prompt_tokens"] == 1


@pytest.mark.slow
def test_openai_client_chat_and_completions(sim: Proc) -> None:
    with openai.OpenAI(base_url=sim.url + "/v1", api_key="unused") as oc:
        chat = oc.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens <= 5
        pieces = [
            c.choices[0].delta.content or ""
            for c in oc.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                stream=True,
            )
            if c.choices
        ]  # fmt: skip
        assert "".join(pieces) == chat.choices[0].message.content
        completion = oc.completions.create(model=MODEL, prompt="hello", max_tokens=3)
        assert completion.choices[0].text


# --- caches ---------------------------------------------------------------------------


@pytest.mark.slow
def test_repeated_prompt_hits_the_prefix_cache(sim: Proc, client: httpx.Client) -> None:
    before = metric(sim.url, "vllm:prefix_cache_hits_total", model_name=MODEL)
    first = client.post("/v1/chat/completions", json=chat_body("cache me", max_tokens=1)).json()
    second = client.post("/v1/chat/completions", json=chat_body("cache me", max_tokens=1)).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * (second["usage"]["prompt_tokens"] // 16 - 1)
    after = metric(sim.url, "vllm:prefix_cache_hits_total", model_name=MODEL)
    assert after - before >= cached > 0


@pytest.mark.slow
def test_cache_salt_separates_prefixes(client: httpx.Client) -> None:
    salted = chat_body("salty question", max_tokens=1, cache_salt="tenant-a")
    client.post("/v1/chat/completions", json=salted)
    other = client.post("/v1/chat/completions", json={**salted, "cache_salt": "tenant-b"}).json()
    again = client.post("/v1/chat/completions", json=salted).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_next_turn_hits_on_the_reply_it_sends_back(client: httpx.Client, stream: bool) -> None:
    """vLLM caches generated blocks too: a follow-up that carries the engine's reply is
    cached through the reply; one that carries other text misses from that point."""
    first = chat_body(f"tell me a long story, stream={stream}", max_tokens=64, ignore_eos=True)
    if stream:
        options = {"stream": True, "stream_options": {"include_usage": True}}
        events = client.post("/v1/chat/completions", json={**first, **options}).text
        frames = [orjson.loads(line[6:]) for line in events.splitlines() if line[6:7] == "{"]
        reply = "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1])
        prompt_tokens = frames[-1]["usage"]["prompt_tokens"]
    else:
        answer = client.post("/v1/chat/completions", json=first).json()
        reply = answer["choices"][0]["message"]["content"]
        prompt_tokens = answer["usage"]["prompt_tokens"]
    assert len(reply) == 64 * 4

    def follow_up(assistant: str) -> dict[str, Any]:
        messages = [*first["messages"], {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": "and then?"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        return client.post("/v1/chat/completions", json=body).json()["usage"]

    other = follow_up("x" * len(reply))
    same = follow_up(reply)
    # Another reply: only what came before it (the first prompt, less the partial block
    # the generation prompt ends in) is cached.
    assert other["prompt_tokens_details"]["cached_tokens"] <= prompt_tokens
    # The engine's own reply: cached through the reply's 64 tokens, less a partial block.
    assert same["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens + 64 - 16
    # Left to compute: the new question in its template (18 tokens), a partial block.
    assert same["prompt_tokens"] - same["prompt_tokens_details"]["cached_tokens"] < 18 + 16


# --- other generate routes --------------------------------------------------------------


@pytest.mark.slow
def test_tokenize_detokenize_round_trip(client: httpx.Client) -> None:
    text = "Hello, wörld! 4 chars a token."
    tok = client.post("/tokenize", json={"prompt": text}).json()
    assert tok["max_model_len"] == 4096
    assert tok["count"] == len(tok["tokens"]) == -(-len(text.encode()) // 4)
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["count"] > 1
    bad = client.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400


@pytest.mark.slow
def test_invocations_dispatch_by_body_shape(client: httpx.Client) -> None:
    chat = client.post("/invocations", json=chat_body("via sagemaker", max_tokens=1))
    assert chat.json()["object"] == "chat.completion"
    completion = client.post("/invocations", json={"prompt": "x", "max_tokens": 1})
    assert completion.json()["object"] == "text_completion"
    neither = client.post("/invocations", json={"something": "else"})
    assert neither.status_code == 400
    assert neither.json()["error"]["code"] == 400


@pytest.mark.slow
def test_audio_transcription_multipart(client: httpx.Client) -> None:
    r = client.post(
        "/v1/audio/transcriptions",
        files={"file": ("a.wav", b"RIFF" + bytes(3000), "audio/wav")},
        data={"model": MODEL},
    )
    assert r.status_code == 200
    assert "3004 bytes" in r.json()["text"]
    missing = client.post("/v1/audio/transcriptions", data={"model": MODEL}, files={"x": b"1"})
    assert missing.status_code == 400


def _two_seconds() -> bytes:
    """8-bit mono PCM at 16 kHz, 2.0 s."""
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 16_000, 16_000, 1, 8)
    body = b"WAVE" + fmt + b"data" + (32_000).to_bytes(4, "little") + bytes(32_000)
    return b"RIFF" + len(body).to_bytes(4, "little") + body


# (route, form fields, status, the answer's keys, its usage): vLLM 0.32's shapes
# (speech_to_text/base/serving.py): `text` is JSON too; translations report no usage;
# srt and vtt are refused by the handler.
SPEECH = [
    ("transcriptions", {}, 200, ["text", "usage"], {"type": "duration", "seconds": 2}),
    ("transcriptions", {"response_format": "text"}, 200, ["text", "usage"],
     {"type": "duration", "seconds": 2}),
    ("transcriptions", {"response_format": "verbose_json"}, 200,
     ["duration", "language", "text", "segments", "words"], None),
    ("translations", {}, 200, ["text"], None),
    ("translations", {"response_format": "text"}, 200, ["text"], None),
    ("translations", {"response_format": "verbose_json"}, 200,
     ["duration", "language", "text", "segments"], None),
    ("transcriptions", {"response_format": "srt"}, 400, ["error"], None),
    ("translations", {"response_format": "vtt"}, 400, ["error"], None),
    ("transcriptions", {"response_format": "xml"}, 400, ["error"], None),
    ("translations", {"response_format": "diarized_json"}, 400, ["error"], None),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("route", "fields", "status", "keys", "usage"), SPEECH)
def test_speech_answers_in_vllm_shapes(
    client: httpx.Client,
    route: str,
    fields: dict[str, str],
    status: int,
    keys: list[str],
    usage: dict[str, object] | None,
) -> None:
    r = client.post(
        f"/v1/audio/{route}",
        files={"file": ("a.wav", _two_seconds(), "audio/wav")},
        data={"model": MODEL, **fields},
    )
    assert r.status_code == status, r.text
    answer = r.json()
    assert list(answer) == keys
    assert answer.get("usage") == usage
    if "duration" in answer:
        assert answer["duration"] == 2.0


@pytest.mark.slow
@pytest.mark.parametrize("route", ["transcriptions", "translations"])
@pytest.mark.parametrize("include", [False, True])
def test_speech_streams_report_tokens_only_when_asked(
    client: httpx.Client, route: str, include: bool
) -> None:
    fields = {"model": MODEL, "stream": "true"}
    if include:
        fields["stream_include_usage"] = "true"
    r = client.post(
        f"/v1/audio/{route}",
        files={"file": ("a.wav", _two_seconds(), "audio/wav")},
        data=fields,
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    events = [orjson.loads(f[len("data: ") :]) for f in frames[:-1]]
    kind = "transcription.chunk" if route == "transcriptions" else "translation.chunk"
    assert {e["object"] for e in events} == {kind}
    assert events[0]["id"].startswith("transcribe-" if route == "transcriptions" else "translate-")
    words = events[:-1] if include else events
    assert all("usage" not in e for e in words)
    assert words[-1]["choices"][0]["finish_reason"] == "stop"
    if include:
        assert events[-1]["choices"] == []
        assert list(events[-1]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]
        assert events[-1]["usage"]["completion_tokens"] == len(words)


# --- errors -----------------------------------------------------------------------------

ERRORS = [
    # (method, path, content, content type, status, message fragment)
    ("POST", "/v1/chat/completions", b"{not json", "application/json", 400, "JSON"),
    ("POST", "/v1/chat/completions", b"[1, 2]", "application/json", 400, "dictionary"),
    ("POST", "/v1/chat/completions", b"{}", "application/json", 400, "messages"),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}', "application/json", 400, "messages"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "application/json",
     400, "role"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"max_tokens": 99999}', "application/json", 400, "maximum context length"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"max_tokens": "ten"}', "application/json", 400, "max_tokens"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"model": "nope"}', "application/json", 404, "The model `nope` does not exist."),
    ("POST", "/v1/chat/completions", b'{"messages": []}', "text/plain", 415, "application/json"),
    ("POST", "/v1/completions", b'{"prompt": 5}', "application/json", 400, "prompt"),
    ("POST", "/v1/completions", b'{"prompt": "x", "prompt_embeds": "AAAA"}',
     "application/json", 400, "prompt_embeds"),
    ("GET", "/v1/chat/completions", b"", "application/json", 405, "Method Not Allowed"),
    ("GET", "/no/such/route", b"", "application/json", 404, "Not Found"),
    ("POST", "/v1/embeddings", b'{"input": "x"}', "application/json", 404, "Not Found"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "content", "ctype", "status", "fragment"), ERRORS)
def test_errors_use_vllm_shape(
    client: httpx.Client,
    method: str,
    path: str,
    content: bytes,
    ctype: str,
    status: int,
    fragment: str,
) -> None:
    r = client.request(method, path, content=content, headers={"content-type": ctype})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert fragment in error["message"]


_CHAT = '{"messages": [{"role": "user", "content": "hi %s"}], "max_tokens": 2%s}'
# Bodies Python's json reads (as vLLM's FastAPI does) and orjson refuses.
LENIENT = {
    "utf-8 BOM": b"\xef\xbb\xbf" + (_CHAT % ("", "")).encode(),
    "utf-16": (_CHAT % ("", "")).encode("utf-16"),
    "NaN": (_CHAT % ("", ', "extra": NaN')).encode(),
    "1e400": (_CHAT % ("", ', "extra": 1e400')).encode(),
}


@pytest.mark.slow
@pytest.mark.parametrize("body", LENIENT.values(), ids=LENIENT.keys())
def test_bodies_are_read_as_vllm_reads_them(client: httpx.Client, body: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(body)
    r = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text


# --- counters, metrics, recorder --------------------------------------------------------


@pytest.mark.slow
def test_received_counter_counts_every_request(sim: Proc, client: httpx.Client) -> None:
    def received(path: str) -> float:
        return metric(sim.url, "sim:received_requests_total", path=path)

    before = {p: received(p) for p in ("unmatched", "/v1/completions", "/sim/requests")}
    client.get("/definitely/unknown/1")
    client.get("/definitely/unknown/2")
    client.post("/v1/completions", content=b"{broken", headers={"content-type": "application/json"})
    client.get("/sim/requests")
    assert received("unmatched") - before["unmatched"] == 2
    assert received("/v1/completions") - before["/v1/completions"] == 1
    assert received("/sim/requests") == 0


@pytest.mark.slow
def test_metrics_parse_with_vllm_names(sim: Proc, client: httpx.Client) -> None:
    client.post("/v1/chat/completions", json=chat_body("metrics", max_tokens=1))
    samples = scrape(sim.url + "/metrics")
    names = {n for n, _ in samples}
    for name in (
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total",
        "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:request_success_total", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc",
        "sim:received_requests_total", "sim:aborted_requests_total",
    ):  # fmt: skip
        assert name in names, name
    labels = dict(next(ls for n, ls in samples if n == "vllm:prompt_tokens_total"))
    assert labels["model_name"] == MODEL
    info = dict(next(ls for n, ls in samples if n == "vllm:cache_config_info"))
    assert info["block_size"] == "16"
    assert metric(sim.url, "vllm:prompt_tokens_total") > 0


@pytest.mark.slow
def test_recorder_shows_what_reached_the_engine(sim: Proc, client: httpx.Client) -> None:
    assert client.delete("/sim/requests").status_code == 200
    client.post(
        "/v1/completions",
        json={"prompt": "recorded", "max_tokens": 1},
        headers={"x-request-id": "rid-1", "authorization": "Bearer abc"},
    )
    client.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "x/y"})
    entries = client.get("/sim/requests").json()
    assert [e["path"] for e in entries] == ["/v1/completions", "/v1/completions"]
    first, second = entries
    assert first["headers"]["x-request-id"] == "rid-1"
    assert first["headers"]["authorization"] == "Bearer abc"
    assert orjson.loads(first["body"])["prompt"] == "recorded"
    assert second["body"] is None and base64.b64decode(second["body_base64"]) == b"\xff\xfe"
    assert client.delete("/sim/requests").json() == {"cleared": 2}
    assert client.get("/sim/requests").json() == []


@pytest.mark.slow
def test_recorder_route_absent_without_flag(guarded: Proc) -> None:
    assert HTTP.get(guarded.url + "/sim/requests").status_code == 404


# --- runtime LoRA -----------------------------------------------------------------------


@pytest.mark.slow
def test_runtime_lora_routes_record_the_path(sim: Proc, client: httpx.Client) -> None:
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": "/etc"})
    assert r.status_code == 200 and "evil" in r.text
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["evil"]["root"] == "/etc" and cards["evil"]["parent"] == MODEL
    served = client.post("/v1/completions", json={"model": "evil", "prompt": "x", "max_tokens": 1})
    assert served.json()["model"] == "evil"
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "evil"}).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "evil"}).status_code == 404
    assert client.post("/adapters", json={"lora_name": "hub", "lora_path": "org/repo"}).is_success
    assert client.get("/v1/models").json()["data"][-1]["root"] == "org/repo"
    assert client.delete("/adapters/hub").status_code == 200
    assert metric(sim.url, "sim:received_requests_total", path="/adapters/{name}") == 1


@pytest.mark.slow
def test_lora_routes_absent_by_default(guarded: Proc) -> None:
    r = HTTP.post(guarded.url + "/adapters", json={"lora_name": "a", "lora_path": "/"})
    assert r.status_code == 404


# --- --api-key, as vLLM applies it -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/v1/models", {}, 401),
        ("GET", "/v1/models", {"authorization": "Bearer wrong"}, 401),
        ("GET", "/v1/models", {"x-api-key": "k3y"}, 401),
        ("GET", "/v1/models", {"authorization": "Bearer k3y"}, 200),
        ("GET", "/v1/nonexistent", {}, 401),
        ("GET", "/health", {}, 200),
        ("GET", "/metrics", {}, 200),
    ],
)
def test_api_key_guards_only_vllm_prefixes(
    guarded: Proc, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    r = HTTP.request(method, guarded.url + path, headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json() == {"error": "Unauthorized"}


@pytest.mark.slow
def test_api_key_leaves_tokenize_and_invocations_open(guarded: Proc) -> None:
    # vLLM's hole (vllm#18892, #58144): these answer without any key.
    before = metric(guarded.url, "vllm:generation_tokens_total")
    tok = HTTP.post(guarded.url + "/tokenize", json={"prompt": "open"})
    assert tok.status_code == 200 and tok.json()["count"] == 1
    inv = HTTP.post(
        guarded.url + "/invocations",
        json={"messages": [{"role": "user", "content": "free inference"}], "max_tokens": 2},
    )
    assert inv.status_code == 200 and inv.json()["object"] == "chat.completion"
    assert metric(guarded.url, "vllm:generation_tokens_total") - before == 2


@pytest.mark.slow
def test_sim_starts_quickly(tmp_path: Path) -> None:
    import time

    proc = sim_proc(tmp_path, "--latency", "zero")
    started = time.monotonic()
    with running(proc):
        # Generous bound for a loaded 2-core CI box; the interface promises < 2 s.
        assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("question", ["hi", "a question of some length, " * 7])
def test_reply_sequence_is_the_next_turns_rendering(question: str) -> None:
    """The reply blocks the sim caches are those of the next turn's prompt: the whole
    conversation rendered with the reply as an assistant message."""
    from bench.sim import prompt as sim_prompt
    from bench.sim.cache import block_hashes

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    tokens, _ = sim_prompt.assemble(sim_prompt.chat_segments(messages), [])
    reply = " The simulated engine answers." * 5
    sequence, start = sim_prompt.reply_sequence(tokens, reply, 16)
    rendered = [*messages, {"role": "assistant", "content": reply}]
    expected, _ = sim_prompt.assemble(sim_prompt.chat_segments(rendered, False), [])
    assert sequence == expected
    # Continuing the prompt's chain gives the blocks hashed from scratch.
    prompt_blocks = block_hashes(tokens, [], 16, cache_salt="s")
    parent = prompt_blocks[start - 1] if start else b""
    tail = block_hashes(sequence, [], 16, cache_salt="s", start=start, parent=parent)
    assert prompt_blocks[:start] + tail == block_hashes(expected, [], 16, cache_salt="s")


# --- the response store (--enable-responses-api-store) ---------------------------------


def test_response_store_keeps_reads_and_refuses_like_vllm(tmp_path: Path, sim: Proc) -> None:
    """A response is kept under the body's request_id unless `store: false`; an unknown
    id, read or continued, is vLLM's 404; a finished one cannot be cancelled. Without
    the flag there is no /v1/responses."""
    body = {"model": MODEL, "input": "Hi.", "max_output_tokens": 4}
    assert HTTP.post(sim.url + "/v1/responses", json=body).status_code == 404
    store = sim_proc(tmp_path, "--latency", "zero", "--enable-responses-api-store")
    with running(store):
        url = store.url + "/v1/responses"
        made = HTTP.post(url, json={**body, "request_id": "kept-1"})
        assert made.status_code == 200, made.text
        assert made.json()["id"] == "kept-1" and made.json()["object"] == "response"
        assert made.json()["usage"]["output_tokens"] == 4
        assert HTTP.get(url + "/kept-1").json() == made.json()
        unstored = HTTP.post(url, json={**body, "request_id": "gone-1", "store": False})
        assert unstored.status_code == 200
        missing = HTTP.get(url + "/gone-1")
        assert missing.status_code == 404
        assert missing.json() == {
            "error": {
                "message": "Response with id 'gone-1' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
        assert HTTP.post(url, json={**body, "previous_response_id": "gone-1"}).status_code == 404
        follow = HTTP.post(url, json={**body, "previous_response_id": "kept-1"})
        assert follow.status_code == 200 and follow.json()["id"].startswith("resp_")
        assert HTTP.post(url + "/kept-1/cancel").status_code == 400
        assert HTTP.post(url + "/gone-1/cancel").status_code == 404
        assert metric(store.url, "sim:received_requests_total", path=RETRIEVE) == 2
