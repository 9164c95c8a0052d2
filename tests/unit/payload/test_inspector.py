"""The payload walker over every body shape in docs/vllm.md, with a real media origin
and a canary on loopback: a disallowed URL anywhere is refused before any connection,
an allowed one is fetched, validated and inlined, dangerous fields are refused."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from pydantic import SecretStr

from gateway.access.endpoints import FORWARDED_GROUPS
from gateway.config.key_file import ApiKey
from gateway.errors import (
    FieldNotAllowed,
    GatewayError,
    InvalidRequest,
    MediaFetchFailed,
    MediaInvalid,
    MediaTooLarge,
    MediaUrlNotAllowed,
)
from gateway.media.settings import MediaSettings
from gateway.media.types import MediaMode, UuidPolicy
from gateway.payload.inspector import PayloadInspector
from gateway.payload.settings import PayloadSettings
from tests.procs import RecordingServer, Route
from tests.unit.media.test_samples import HTML, SVG, data_url, jpeg, media_digest, png, wav
from tests.unit.payload.digests import digests

PNG = png()
PNG_B64 = base64.b64encode(PNG).decode()
PNG_HASH = media_digest(PNG)


@pytest.fixture(scope="module")
def origin(canary: RecordingServer) -> Iterator[RecordingServer]:
    routes = {
        "/img.png": Route(body=PNG, headers={"Content-Type": "image/png"}),
        "/other.png": Route(body=PNG, headers={"Content-Type": "image/png"}),
        "/svg": Route(body=SVG, headers={"Content-Type": "image/svg+xml"}),
        "/redirect": Route(status=302, headers={"Location": canary.url + "/stolen"}),
    }
    with RecordingServer(routes) as server:
        yield server


def make_settings(origin: RecordingServer, **overrides: Any) -> MediaSettings:
    base: dict[str, Any] = {
        "allowed_domains": [f"127.0.0.1:{origin.port}"],
        "allowed_schemes": ["http"],
        "allowed_networks": ["127.0.0.0/8"],
        "fetch_timeout": 2.0,
    }
    base.update(overrides)
    return MediaSettings.model_validate(base)


PAYLOAD = PayloadSettings(namespace_secret=SecretStr("test-namespace-secret"))


def key(name: str, tenant: str | None = None, secret: str | None = None) -> ApiKey:
    digest = hashlib.sha256((secret or f"secret-of-{name}").encode()).digest()
    return ApiKey(name, digest, FORWARDED_GROUPS, None, tenant)


async def inspect(
    settings: MediaSettings, body: dict[str, Any], path: str = "/v1/chat/completions",
    key_name: str = "tenant-a", payload: PayloadSettings | None = None,
) -> list[str]:  # fmt: skip
    """The walk is the same on every route; `path` only labels the table rows."""
    inspector = PayloadInspector(settings, payload or PAYLOAD)
    try:
        return digests(await inspector.inspect(body, key(key_name)))
    finally:
        await inspector.aclose()


def chat(part: dict[str, Any], role: str = "user") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": role, "content": [part]}]}


def img_part(u: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": u}}


# (path, body builder): every place an image URL can sit.
IMAGE_SHAPES: list[tuple[str, Callable[[str], dict[str, Any]]]] = [
    ("/v1/chat/completions", lambda u: chat(img_part(u))),
    ("/v1/chat/completions", lambda u: chat({"type": "image_url", "image_url": u})),
    ("/v1/chat/completions", lambda u: chat({"image_url": {"url": u}})),
    ("/v1/chat/completions", lambda u: chat({"image_url": u})),
    ("/v1/chat/completions", lambda u: chat({"type": "text", "image_url": u})),
    ("/v1/chat/completions", lambda u: chat({"type": "input_image", "image_url": u})),
    ("/v1/chat/completions", lambda u: chat(img_part(u), role="system")),
    ("/v1/chat/completions", lambda u: chat(img_part(u), role="assistant")),
    ("/v1/chat/completions", lambda u: chat(img_part(u), role="tool")),
    ("/v1/chat/completions", lambda u: chat(img_part(u), role="developer")),
    ("/v1/chat/completions", lambda u: chat(img_part(u), role="custom_role")),
    ("/v1/chat/completions", lambda u: chat({**img_part(u), "uuid": "abc"})),
    ("/v1/chat/completions", lambda u: {"messages": [
        {"role": "user", "content": "hi"}, {"role": "user", "content": [
            {"type": "text", "text": "look"}, img_part(u)]}]}),
    ("/cohere/v2/chat", lambda u: chat(img_part(u))),
    ("/tokenize", lambda u: chat(img_part(u))),
    ("/pooling", lambda u: chat(img_part(u))),
    ("/classify", lambda u: chat(img_part(u))),
    ("/v1/embeddings", lambda u: chat(img_part(u))),
    ("/v1/embeddings", lambda u: {"input": [{"role": "user", "content": [img_part(u)]}]}),
    ("/invocations", lambda u: chat(img_part(u))),
    ("/v1/responses", lambda u: {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": u}]}]}),
    ("/v1/responses", lambda u: {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": u}]}]}),
    ("/v1/responses", lambda u: {"input": [{"type": "function_call_output", "call_id": "c",
        "output": [{"type": "input_image", "image_url": u}]}]}),
    ("/v1/messages", lambda u: {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": u}}]}]}),
    ("/v1/messages", lambda u: {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": u}}]}]}]}),
    ("/score", lambda u: {"text_1": "q", "text_2": {"content": [img_part(u)]}}),
    ("/v1/score", lambda u: {"data_1": {"content": [img_part(u)]}, "data_2": ["a"]}),
    ("/rerank", lambda u: {"query": "q", "documents": {"content": [img_part(u)]}}),
    ("/v1/rerank", lambda u: {"query": {"content": [img_part(u)]}, "documents": ["d"]}),
    ("/v2/rerank", lambda u: {"query": "q", "documents": [{"content": [img_part(u)]}]}),
    ("/v2/rerank", lambda u: {"queries": [{"content": [img_part(u)]}], "documents": ["d"]}),
    ("/v2/embed", lambda u: {"images": [u], "input_type": "image"}),
    ("/v2/embed", lambda u: {"inputs": [{"content": [{"type": "text", "text": "t"},
                                                      img_part(u)]}]}),
    ("/v1/systemone", lambda u: {"images": [u]}),
    ("/v1/systemone", lambda u: {"images": u}),
    # An extra key on a part or item switches nothing off (a real vLLM fetched these
    # through the first release: it drops unknown keys from content parts).
    ("/v1/chat/completions", lambda u: chat({**img_part(u), "role": "user"})),
    ("/v1/chat/completions", lambda u: chat({**img_part(u), "role": None})),
    ("/v1/chat/completions", lambda u: chat({**img_part(u), "role": "user"}, role="system")),
    ("/v1/chat/completions", lambda u: chat({"image_url": u, "role": "tool", "name": "n"})),
    ("/v1/chat/completions/batch", lambda u: {"messages": [[{"role": "user", "content": [
        {**img_part(u), "role": "user"}]}]]}),
    ("/tokenize", lambda u: chat({**img_part(u), "role": "user"})),
    ("/invocations", lambda u: chat({**img_part(u), "role": "user"})),
    ("/pooling", lambda u: chat({**img_part(u), "role": "user"})),
    ("/v1/embeddings", lambda u: {"input": [{"role": "user", "content": [
        {**img_part(u), "role": "user"}]}]}),
    ("/cohere/v2/chat", lambda u: chat({**img_part(u), "role": "user"})),
    ("/score", lambda u: {"text_1": "q", "text_2": {"content": [
        {**img_part(u), "role": "user"}]}}),
    ("/v2/rerank", lambda u: {"query": "q", "documents": [{"role": "user", "content": [
        {**img_part(u), "role": "user"}]}]}),
    ("/v2/embed", lambda u: {"inputs": [{"content": [{**img_part(u), "role": "user"}]}]}),
    ("/v1/responses", lambda u: {"input": [{"role": "user", "type": "input_image",
                                            "image_url": u}]}),
    ("/v1/responses", lambda u: {"input": [{"type": "custom_tool_call_output", "call_id": "c",
        "output": [{"type": "input_image", "image_url": u}]}]}),
    ("/v1/responses", lambda u: {"input": [{"type": "function_call_output", "call_id": "c",
        "output": [{"type": "input_image", "image_url": u, "role": "user"}]}]}),
    ("/v1/messages", lambda u: {"messages": [{"role": "user", "content": [
        {"type": "image", "role": "user", "source": {"type": "url", "url": u}}]}]}),
    ("/v1/messages", lambda u: {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "role": "user", "tool_use_id": "t", "content": [
            {"type": "image", "role": None, "source": {"type": "url", "url": u}}]}]}]}),
    # Wherever a media key sits, at any depth, under any key.
    ("/v1/chat/completions", lambda u: {"messages": [{"role": "user", "content": "hi",
                                                      "image_url": u}]}),
    ("/v1/chat/completions", lambda u: chat({"type": "text", "text": "x",
                                             "extra": {"deeper": [{"image_url": u}]}})),
    ("/v1/chat/completions", lambda u: {"anything": {"image_url": {"url": u}}}),
]  # fmt: skip

# Shapes with other kinds or unknown shapes: refused when the URL is disallowed.
OTHER_SHAPES: list[tuple[str, Callable[[str], dict[str, Any]]]] = [
    ("/v1/chat/completions", lambda u: chat({"type": "video_url", "video_url": {"url": u}})),
    ("/v1/chat/completions", lambda u: chat({"video_url": u})),
    ("/v1/chat/completions", lambda u: chat({"type": "audio_url", "audio_url": {"url": u}})),
    ("/v1/chat/completions", lambda u: chat({"audio_url": u})),
    ("/v1/chat/completions", lambda u: chat({"type": "file", "file": {"url": u}})),
    ("/v1/chat/completions", lambda u: chat({"image": u})),
    ("/v1/chat/completions", lambda u: chat({"type": "input_file", "file_url": u})),
    ("/v1/messages", lambda u: {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "url", "url": u}}]}]}),
    ("/v1/messages", lambda u: {"system": [{"type": "image", "source": {"type": "url",
                                                                        "url": u}}]}),
    ("/v1/systemone", lambda u: {"audio": [u]}),
    ("/v1/systemone", lambda u: {"videos": [u]}),
]  # fmt: skip

DISALLOWED = [
    "http://169.254.169.254/latest/meta-data/",
    "http://127.0.0.1:{canary}/x.png",
    "http://2130706433:{canary}/",
    "http://[::1]:{canary}/",
    "http://127.0.0.1:{origin}\\@evil.example/",
    "file:///etc/passwd",
    "/etc/passwd",
    "https://evil.example/a.png",
]


@pytest.fixture(scope="module")
def shared(origin: RecordingServer) -> Iterator[PayloadInspector]:
    """One inspector for the refusal table: refusals do no I/O, so no event loop is
    bound, and building an httpx client (its TLS context) per row costs ~40 ms."""
    inspector = PayloadInspector(make_settings(origin))
    yield inspector
    asyncio.run(inspector.aclose())


@pytest.mark.parametrize("raw", DISALLOWED)
@pytest.mark.parametrize(("path", "build"), IMAGE_SHAPES + OTHER_SHAPES)
async def test_a_disallowed_url_anywhere_is_refused(
    origin: RecordingServer, canary: RecordingServer, shared: PayloadInspector, path: str,
    build: Callable[[str], dict[str, Any]], raw: str,
) -> None:  # fmt: skip
    before = len(origin.hits)
    u = raw.format(canary=canary.port, origin=origin.port)
    with pytest.raises(MediaUrlNotAllowed) as info:
        await shared.inspect(build(u), key("k"))
    assert info.value.status == 400 and info.value.code == "media_url_not_allowed"
    assert info.value.param  # names where in the body
    assert not canary.contacted
    assert len(origin.hits) == before


@pytest.mark.parametrize(("path", "build"), IMAGE_SHAPES)
async def test_an_allowed_image_is_fetched_validated_and_inlined(
    origin: RecordingServer, path: str, build: Callable[[str], dict[str, Any]]
) -> None:
    u = f"http://127.0.0.1:{origin.port}/img.png"
    body = build(u)
    hashes = await inspect(make_settings(origin, cache_ttl=0), body, path)
    assert hashes == [PNG_HASH]
    text = orjson.dumps(body).decode()
    assert u not in text and "127.0.0.1" not in text
    assert PNG_B64 in text


async def test_same_image_twice_has_the_same_hash_and_is_fetched_once(
    origin: RecordingServer,
) -> None:
    u = f"http://127.0.0.1:{origin.port}/other.png"
    parts = [img_part(u), img_part(u), img_part(data_url("image/png", PNG))]
    body = {"messages": [{"role": "user", "content": parts}]}
    inspector = PayloadInspector(make_settings(origin))
    try:
        before = sum(h.path == "/other.png" for h in origin.hits)
        hashes = digests(await inspector.inspect(body, key("k")))
        again = digests(await inspector.inspect(chat(img_part(u)), key("k")))
    finally:
        await inspector.aclose()
    assert hashes == [PNG_HASH] * 3 and again == [PNG_HASH]
    # Two concurrent fetches at most for the first request, none for the cached second.
    assert sum(h.path == "/other.png" for h in origin.hits) - before <= 2
    other = media_digest(png(9, 9))
    assert await inspect(
        make_settings(origin), chat(img_part(data_url("image/png", png(9, 9))))
    ) == [other]


async def test_redirects_through_the_walker_are_422_and_canary_untouched(
    origin: RecordingServer, canary: RecordingServer
) -> None:
    body = chat(img_part(f"http://127.0.0.1:{origin.port}/redirect"))
    with pytest.raises(MediaFetchFailed, match="redirect") as info:
        await inspect(make_settings(origin), body)
    assert info.value.status == 422
    assert not canary.contacted


@pytest.mark.parametrize(
    ("part", "error"),
    [
        (img_part(data_url("image/svg+xml", SVG)), MediaInvalid),
        (img_part(data_url("image/png", SVG)), MediaInvalid),
        (img_part(data_url("text/html", HTML)), MediaInvalid),
        (img_part(data_url("application/postscript", b"%!PS-Adobe-3.0\n")), MediaInvalid),
        (img_part(data_url("image/jpeg", PNG)), MediaInvalid),
        (img_part(data_url("video/mp4", PNG)), MediaInvalid),
        (img_part("data:image/png;base64,@@@"), MediaInvalid),
        (img_part("data:image/png;base64," + "A" * 40_000), MediaTooLarge),
        ({"type": "audio_url", "audio_url": {"url": data_url("audio/wav", PNG)}}, MediaInvalid),
        ({"type": "video_url", "video_url": {"url": data_url("video/jpeg", PNG)}}, MediaInvalid),
        ({"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}, MediaInvalid),
        ({"type": "input_audio", "input_audio": {"data": PNG_B64, "format": "wav"}},
         MediaInvalid),
        ({"type": "input_audio", "input_audio": {"data": PNG_B64, "format": "exe"}},
         MediaInvalid),
        ({"type": "input_audio", "input_audio": "http://x"}, MediaInvalid),
        ({"type": "image_url", "image_url": {"href": "x"}}, MediaUrlNotAllowed),
        ({"type": "image_url", "image_url": {"detail": "auto"}}, MediaInvalid),
        ({"type": "image_url", "image_url": 5}, MediaInvalid),
        ({"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                         "data": PNG_B64}}, MediaInvalid),
        ({"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml",
                                      "data": base64.b64encode(SVG).decode()}}, MediaInvalid),
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, MediaInvalid),
        # vLLM 0.32 decides a source by its type: a URL on any other type is never read,
        # and `data` would be decoded instead, unchecked in passthrough mode.
        ({"type": "image", "source": {"type": "weird", "url": data_url("image/png", PNG)}},
         MediaInvalid),
        ({"type": "image", "source": {"type": "base64", "url": data_url("image/png", PNG),
                                      "media_type": "text/html", "data": PNG_B64}}, MediaInvalid),
        ({"type": "image", "source": {"media_type": "image/png", "data": PNG_B64}},
         MediaInvalid),
    ],
)  # fmt: skip
async def test_bad_inline_media_is_refused(
    origin: RecordingServer, part: dict[str, Any], error: type[GatewayError]
) -> None:
    with pytest.raises(error) as info:
        await inspect(make_settings(origin, max_bytes=20_000), chat(part))
    assert info.value.status in (400, 413)


async def test_a_fetched_svg_is_refused(origin: RecordingServer) -> None:
    with pytest.raises(MediaInvalid):
        await inspect(make_settings(origin), chat(img_part(f"http://127.0.0.1:{origin.port}/svg")))


async def test_inline_audio_video_and_base64_sources_are_validated_and_kept(
    origin: RecordingServer,
) -> None:
    audio = wav()
    frames = ",".join(base64.b64encode(f).decode() for f in (jpeg(), jpeg(4, 4)))
    body = {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(),
                                                "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": data_url("audio/wav", audio)}},
        {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + frames}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG_B64}},
    ]}]}  # fmt: skip
    hashes = await inspect(make_settings(origin), body)
    assert hashes[0] == hashes[1] == media_digest(audio)
    assert hashes[3] == PNG_HASH and len(set(hashes)) == 3
    content = body["messages"][0]["content"]
    assert content[2]["video_url"]["url"] == "data:video/jpeg;base64," + frames


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"prompt": {"prompt_embeds": "AAAA"}}, "prompt.prompt_embeds"),
        ({"prompt": [{"prompt_embeds": "AAAA"}]}, "prompt[0].prompt_embeds"),
        (chat({"type": "prompt_embeds", "data": "AAAA"}), "messages[0].content[0]"),
        (chat({"type": "image_embeds", "image_embeds": "AAAA"}),
         "messages[0].content[0].image_embeds"),
        (chat({"image_embeds": {"image_embeds": "AAAA"}}), "messages[0].content[0].image_embeds"),
        (chat({"type": "audio_embeds", "audio_embeds": "AAAA"}),
         "messages[0].content[0].audio_embeds"),
        (chat({"type": "video_embeds", "video_embeds": "AAAA"}),
         "messages[0].content[0].video_embeds"),
        (chat({"type": "image_embeds", "data": "AAAA"}), "messages[0].content[0]"),
        ({"prompt": {"prompt": "x", "multi_modal_data": {"image": "u"}}},
         "prompt.multi_modal_data"),
        ({"prompt": "x", "vllm_xargs": {"kv_transfer_params": {}}},
         "vllm_xargs.kv_transfer_params"),
        ({"prompt": "x", "vllm_xargs": {"custom": 1}}, "vllm_xargs.custom"),
        ({"prompt": "x", "data": {"x": 1}}, "data"),
        ({"prompt": "x", "priority": -10}, "priority"),
        (chat({"type": "text", "text": "x"}) | {"kv_transfer_params": {"do_remote_prefill": True}},
         "kv_transfer_params"),
        ({"prompt": "x", "ec_transfer_params": {}}, "ec_transfer_params"),
        ({"messages": [], "media_io_kwargs": {"video": {"num_frames": -1}}}, "media_io_kwargs"),
        ({"messages": [], "mm_processor_kwargs": {"num_frames": -1}}, "mm_processor_kwargs"),
        ({"messages": [], "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": [], "chat_template_kwargs": {"chat_template": "{{ x }}"}},
         "chat_template_kwargs.chat_template"),
        ({"input": [{"role": "user", "content": [{"type": "image_embeds",
                                                  "image_embeds": "A"}]}]},
         "input[0].content[0].image_embeds"),
    ],
)  # fmt: skip
async def test_dangerous_fields_are_refused_by_default(
    origin: RecordingServer, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(FieldNotAllowed) as info:
        await inspect(make_settings(origin), body)
    assert info.value.status == 400 and info.value.code == "field_not_allowed"
    assert info.value.param == field


@pytest.mark.parametrize(
    ("body", "setting"),
    [
        ({"prompt": "x", "prompt_embeds": "AAAA"}, "allow_prompt_embeds"),
        (chat({"type": "image_embeds", "image_embeds": "AAAA"}), "allow_embeds_parts"),
        ({"prompt": "x", "kv_transfer_params": {}}, "allow_kv_transfer_params"),
        ({"prompt": "x", "ec_transfer_params": {}}, "allow_ec_transfer_params"),
        ({"messages": [], "media_io_kwargs": {}}, "allow_media_io_kwargs"),
        ({"messages": [], "mm_processor_kwargs": {}}, "allow_mm_processor_kwargs"),
        ({"messages": [], "chat_template": "x"}, "allow_chat_template"),
    ],
)
async def test_each_dangerous_field_has_an_explicit_opt_in(
    origin: RecordingServer, body: dict[str, Any], setting: str
) -> None:
    assert await inspect(make_settings(origin, **{setting: True}), body) == []


async def test_uuids_are_namespaced_per_key(origin: RecordingServer) -> None:
    settings = make_settings(origin)
    part = {**img_part(data_url("image/png", PNG)), "uuid": "shared-id"}
    bodies = [chat(dict(part)) for _ in range(3)]
    await inspect(settings, bodies[0], key_name="tenant-a")
    await inspect(settings, bodies[1], key_name="tenant-a")
    await inspect(settings, bodies[2], key_name="tenant-b")
    uuids = [b["messages"][0]["content"][0]["uuid"] for b in bodies]
    assert uuids[0] == uuids[1] != uuids[2]
    assert all(u != "shared-id" and u.startswith("gw-") for u in uuids)
    # A uuid alone (vLLM reads the cached item) can only name the caller's own items.
    ref_only = chat({"type": "image_url", "image_url": None, "uuid": "shared-id"})
    hashes = await inspect(settings, ref_only, key_name="tenant-b")
    assert ref_only["messages"][0]["content"][0]["uuid"] == uuids[2] == hashes[0]


async def test_uuid_drop_policy(origin: RecordingServer) -> None:
    settings = make_settings(origin, uuids=UuidPolicy.drop)
    body = chat({**img_part(data_url("image/png", PNG)), "uuid": "x"})
    await inspect(settings, body)
    assert "uuid" not in body["messages"][0]["content"][0]
    with pytest.raises(FieldNotAllowed):
        await inspect(settings, chat({"type": "image_url", "image_url": None, "uuid": "x"}))


@pytest.mark.parametrize("salt", ["x" * 257, 5, ["a"]])
async def test_cache_salt_is_capped(origin: RecordingServer, salt: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        await inspect(make_settings(origin), {"prompt": "x", "cache_salt": salt})
    assert info.value.param == "cache_salt"
    assert await inspect(make_settings(origin), {"prompt": "x", "cache_salt": "x" * 256}) == []


async def test_passthrough_forwards_the_canonical_url_without_fetching(
    origin: RecordingServer,
) -> None:
    settings = make_settings(origin, mode=MediaMode.passthrough)
    before = len(origin.hits)
    body = chat(img_part(f"HTTP://127.0.0.1:{origin.port}/img.png?a=1"))
    source = {"type": "url", "url": f"HTTP://127.0.0.1:{origin.port}/img.png", "data": "x"}
    msgs = {"messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}
    hashes = await inspect(settings, body)
    await inspect(settings, msgs, "/v1/messages")
    assert body["messages"][0]["content"][0]["image_url"]["url"] == (
        f"http://127.0.0.1:{origin.port}/img.png?a=1"
    )
    # The source is rebuilt from the checked URL alone: nothing else of it is forwarded.
    forwarded = msgs["messages"][0]["content"][0]["source"]
    assert forwarded == {"type": "url", "url": f"http://127.0.0.1:{origin.port}/img.png"}
    assert len(hashes) == 1 and hashes[0] != PNG_HASH
    assert len(origin.hits) == before
    with pytest.raises(MediaUrlNotAllowed):
        await inspect(settings, chat(img_part("http://169.254.169.254/")))
    with pytest.raises(MediaInvalid):
        await inspect(settings, chat(img_part(data_url("image/svg+xml", SVG))))


async def test_data_only_mode(origin: RecordingServer, canary: RecordingServer) -> None:
    settings = make_settings(origin, mode=MediaMode.data_only)
    with pytest.raises(MediaUrlNotAllowed, match="rule: mode"):
        await inspect(settings, chat(img_part(f"http://127.0.0.1:{origin.port}/img.png")))
    assert await inspect(settings, chat(img_part(data_url("image/png", PNG)))) == [PNG_HASH]


async def test_item_and_nesting_caps(origin: RecordingServer) -> None:
    settings = make_settings(origin, max_items=2)
    parts = [img_part(data_url("image/png", PNG))] * 3
    with pytest.raises(MediaTooLarge):
        await inspect(settings, {"messages": [{"role": "user", "content": parts}]})
    deep: Any = [img_part("http://169.254.169.254/")]
    for _ in range(40):
        deep = [{"type": "tool_result", "content": deep}]
    with pytest.raises(InvalidRequest):
        await inspect(settings, {"messages": [{"role": "user", "content": deep}]})


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "https://evil.example/a.png"}]},
        {"input": ["http://169.254.169.254/", "text"]},
        {"prompt": "see file:///etc/passwd"},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"url": {"type": "string"}}}}}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f",
                                                         "arguments": '{"url": "x"}'}}]}]},
        {"audio": {"voice": "alloy", "format": "wav"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"image_url": 1}}}},
        # vLLM reads no URL from these keys, so they are not media wherever they sit.
        chat({"type": "weird", "url": "https://evil.example/a.png"}),
        chat({"src": "http://169.254.169.254/"}),
        {"messages": [{"role": "assistant", "content": [{"type": "output_text", "text": "t",
            "annotations": [{"type": "url_citation", "url": "https://evil.example/"}]}]}]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"image_url": {"type": ["string", "null"]},
                                             "source": {"type": "string"},
                                             "priority": {"type": "integer"}}}}}]},
    ],
)  # fmt: skip
async def test_text_that_mentions_urls_is_not_media(
    origin: RecordingServer, body: dict[str, Any]
) -> None:
    copy = orjson.loads(orjson.dumps(body))
    assert await inspect(make_settings(origin), body) == []
    assert body == copy


async def test_a_data_image_sent_again_is_not_validated_again_but_keeps_its_checks(
    origin: RecordingServer,
) -> None:
    """Repeated inline images are served from the validation cache; the cache key holds
    the declared type, so a cached verdict never lets a mislabelled copy through."""
    inspector = PayloadInspector(make_settings(origin))
    cache = inspector._inliner._cache
    good = data_url("image/png", PNG)
    try:
        first = chat(img_part(good))
        assert digests(await inspector.inspect(first, key("k"))) == [PNG_HASH]
        assert len(cache) == 1
        again = chat(img_part(good))
        assert digests(await inspector.inspect(again, key("k"))) == [PNG_HASH]
        assert len(cache) == 1  # served from the cache, not validated into a new entry
        assert again == first
        # The same bytes declared as JPEG are still refused, and nothing is cached for them.
        with pytest.raises(MediaInvalid):
            await inspector.inspect(chat(img_part(data_url("image/jpeg", PNG))), key("k"))
        assert len(cache) == 1
    finally:
        await inspector.aclose()


async def test_uuids_depend_on_the_deployment_secret(origin: RecordingServer) -> None:
    part = {**img_part(data_url("image/png", PNG)), "uuid": "shared-id"}
    other = PayloadSettings(namespace_secret=SecretStr("another-namespace-secret"))
    a, b = chat(dict(part)), chat(dict(part))
    await inspect(make_settings(origin), a)
    await inspect(make_settings(origin), b, payload=other)
    assert a["messages"][0]["content"][0]["uuid"] != b["messages"][0]["content"][0]["uuid"]


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": ["image_url"], "image_url": "data:,"}, "messages[0].content[0].type"),
        ({"type": {"x": 1}, "image_url": {"url": "data:,"}}, "messages[0].content[0].type"),
        ({"type": 7, "input_image": "data:,"}, "messages[0].content[0].type"),
    ],
)
async def test_a_media_part_with_a_type_that_is_not_a_string_is_400(
    origin: RecordingServer, part: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await inspect(make_settings(origin), chat(part))
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_request", param)


async def test_request_ids_are_namespaced_per_key() -> None:
    settings = MediaSettings()
    bodies = [{"input": "x", "request_id": "resp_mine"} for _ in range(3)]
    inspector = PayloadInspector(settings, PAYLOAD)
    try:
        changed = [await inspector.inspect(b, key(k)) for b, k in zip(bodies, "aab", strict=True)]
        for bad in (5, "", "x" * 129, ["a"]):
            with pytest.raises(InvalidRequest) as info:
                await inspector.inspect({"input": "x", "request_id": bad}, key("a"))
            assert info.value.param == "request_id"
    finally:
        await inspector.aclose()
    ids = [b["request_id"] for b in bodies]
    assert ids[0] == ids[1] != ids[2] and "resp_mine" not in ids
    assert all(c.changed and digests(c) == [] for c in changed)


@pytest.mark.parametrize(("mode", "same_tenant_shares"), [("key", False), ("tenant", True)])
async def test_cache_isolation_salts_every_request_per_key_or_tenant(
    mode: str, same_tenant_shares: bool
) -> None:
    payload = PayloadSettings(namespace_secret=SecretStr("test-namespace-secret"),
                              cache_isolation=mode)  # fmt: skip
    inspector = PayloadInspector(MediaSettings(), payload)
    keys = [key("a1", "team-a"), key("a2", "team-a"), key("b1", "team-b")]
    try:
        salts = []
        for k in keys:
            body: dict[str, Any] = {"prompt": "x"}
            assert (await inspector.inspect(body, k)).changed
            salts.append(body["cache_salt"])
        own: dict[str, Any] = {"prompt": "x", "cache_salt": "mine"}
        await inspector.inspect(own, keys[0])
    finally:
        await inspector.aclose()
    assert salts[2] not in salts[:2]
    assert (salts[0] == salts[1]) is same_tenant_shares
    # A client's own salt still partitions the cache, within its tenant only.
    assert own["cache_salt"] not in (*salts, "mine")


async def test_without_cache_isolation_a_body_is_forwarded_as_sent() -> None:
    inspector = PayloadInspector(MediaSettings(), PAYLOAD)
    body: dict[str, Any] = {"prompt": "x", "cache_salt": "s", "tools": [{"uuid": "u"}]}
    try:
        inspection = await inspector.inspect(body, key("a"))
    finally:
        await inspector.aclose()
    assert not inspection.changed
    assert body == {"prompt": "x", "cache_salt": "s", "tools": [{"uuid": "u"}]}


@pytest.mark.parametrize(
    ("body", "payload"),
    [
        ({"prompt": "x", "vllm_xargs": {"my_processor_arg": 1}},
         {"vllm_xargs_keys": ["my_processor_arg"]}),
        ({"data": {"plugin": "input"}}, {"allow_pooling_data": True}),
        ({"prompt": "x", "priority": 5}, {"allow_priority": True}),
        ({"input": "x", "background": True}, {"allow_background": True}),
    ],
)  # fmt: skip
async def test_engine_controls_pass_only_as_the_operator_allows(
    body: dict[str, Any], payload: dict[str, Any]
) -> None:
    copy = orjson.loads(orjson.dumps(body))
    allowed = PayloadSettings(namespace_secret=SecretStr("test-namespace-secret"), **payload)
    inspector = PayloadInspector(MediaSettings(), allowed)
    try:
        assert not (await inspector.inspect(body, key("a"))).changed
    finally:
        await inspector.aclose()
    assert body == copy
    with pytest.raises(FieldNotAllowed):
        await inspect(MediaSettings(), copy)


def test_engine_controls_cannot_be_listed_as_vllm_xargs_keys() -> None:
    for control in ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"):
        with pytest.raises(ValueError, match="engine controls"):
            PayloadSettings(vllm_xargs_keys=["ok", control])
    with pytest.raises(ValueError, match="16 characters"):
        PayloadSettings(namespace_secret=SecretStr("short"))


async def test_media_digests_are_reported_by_path(origin: RecordingServer) -> None:
    other = png(9, 9)
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, img_part(data_url("image/png", PNG)),
        {"image_url": data_url("image/png", other), "role": "user"}]}]}  # fmt: skip
    inspector = PayloadInspector(make_settings(origin), PAYLOAD)
    try:
        inspection = await inspector.inspect(body, key("a"))
    finally:
        await inspector.aclose()
    assert inspection.media == (
        ("messages[0].content[1].image_url.url", PNG_HASH),
        ("messages[0].content[2].image_url", media_digest(other)),
    )


async def test_identifiers_follow_the_key_not_its_name() -> None:
    """Names are labels: unnamed keys are numbered by position (`key-3`), so a key file
    edited later may give a name to another key. Its identifiers stay its own."""
    inspector = PayloadInspector(MediaSettings(), PAYLOAD)
    bodies = [{"prompt": "x", "request_id": "r1"} for _ in range(3)]
    try:
        await inspector.inspect(bodies[0], key("key-1", secret="first-key-0123456789"))
        await inspector.inspect(bodies[1], key("key-1", secret="second-key-0123456789"))
        await inspector.inspect(bodies[2], key("renamed", secret="first-key-0123456789"))
    finally:
        await inspector.aclose()
    ids = [b["request_id"] for b in bodies]
    assert ids[0] == ids[2] != ids[1]


async def test_session_ids_are_namespaced_per_key() -> None:
    inspector = PayloadInspector(MediaSettings(), PAYLOAD)
    bodies = [{"prompt": "x", "session_id": "victim-session"} for _ in range(2)]
    try:
        await inspector.inspect(bodies[0], key("a"))
        await inspector.inspect(bodies[1], key("b"))
    finally:
        await inspector.aclose()
    ids = [b["session_id"] for b in bodies]
    assert ids[0] != ids[1] and "victim-session" not in ids


async def test_an_untyped_embeds_part_is_a_part_whose_uuid_is_namespaced() -> None:
    body = chat({"uuid": "their-cached-embeds", "image_embeds": None})
    await inspect(MediaSettings(), body)
    assert body["messages"][0]["content"][0]["uuid"].startswith("gw-")


async def test_input_audio_without_data_in_an_untyped_object_is_not_media() -> None:
    schema = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"input_audio": {"type": "string"}}}}}]}  # fmt: skip
    assert await inspect(MediaSettings(), schema) == []
    with pytest.raises(MediaInvalid):
        await inspect(MediaSettings(), chat({"type": "input_audio", "input_audio": {}}))
