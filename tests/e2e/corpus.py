"""A generated corpus of request bodies that carry media references, for checking the
gateway from outside.

The grammar is containers x media part shapes x sources x decorations x nestings:

- containers: every JSON route the endpoint table forwards, and every body shape vLLM
  0.32 reads content parts from: chat messages in every role (chat completions,
  /tokenize, /invocations with chat, completion and pooling bodies, batch chat,
  /v1/embeddings, /pooling, /classify, /cohere/v2/chat), /v1/responses input items
  (messages with and without `type`, `function_call_output` and
  `custom_tool_call_output` `output` lists), /v1/messages and count_tokens content blocks
  (user and assistant blocks, `tool_result.content`), score and rerank
  queries/documents as `{"content": [...]}`, /v2/embed `inputs[].content`; /v2/embed
  `images` is its own family (a list of URL strings); every other JSON route once with
  chat messages, because /invocations and vLLM's request models pick the shape by keys.
- part shapes, from vLLM 0.32's `chat_utils._parse_chat_message_content_mm_part` and the
  Anthropic converter: `image_url: {url}` (with `detail`, with `uuid`), bare `image_url`
  string with and without `type`, `input_image` with a string (vLLM's shape) and an
  object, `video_url` and `audio_url` in both forms, `input_audio`, Anthropic
  `image.source` url and base64.
- sources: the allowed origin (`ORIGIN`), a canary that is never allowed (`CANARY`), and
  inline `data:` URLs / base64.
- decorations on the media part: keys vLLM drops silently (`role` with any value
  including null, `name`, unknown keys, `content`), `uuid`, and `type` removed or set to
  other strings, lists, objects, numbers and null.
- nestings: flat, the part wrapped in a list or an object, deep nesting, the content as
  one object, the part's keys on the message itself, the part twice.

Each `Case` knows its route, its body (with the placeholders `@@ORIGIN@@`, `@@CANARY@@`
and `@@MODEL@@`, filled in by `render`) and the JSON paths where it placed media
(`media_paths`, found by value, so the same function serves mutated bodies). A case is
`evil` when it put the canary in any media position, and `legit` when it is a shape the
docs list as supported, with allowed media or text that merely mentions URLs: legit
bodies must be served, or "refuse everything" would pass.

`check` holds the invariants for one exchange through the gateway; the fast suite
(`tests/e2e/test_payload_corpus.py`, a recording engine) and the real tier
(`tests/real/test_payload_corpus_real.py`, a real vLLM) both use it.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness.samples import MP4, png, wav
from gateway.media.types import MEDIA_KEYS, MEDIA_TYPES

ORIGIN = "@@ORIGIN@@"
CANARY = "@@CANARY@@"
MODEL = "@@MODEL@@"

PNG = png(64, 64, (30, 160, 90))
WAV = wav()
B64_PNG = base64.b64encode(PNG).decode()
B64_WAV = base64.b64encode(WAV).decode()
DATA = {
    "image": "data:image/png;base64," + B64_PNG,
    "audio": "data:audio/wav;base64," + B64_WAV,
    "video": "data:video/mp4;base64," + base64.b64encode(MP4).decode(),
}
# Bytes an embeds part would make vLLM torch.load (never sent anywhere: refused first).
EMBEDS = base64.b64encode(b"PK\x03\x04 not a tensor").decode()
# What the origin serves at each path (path -> (bytes, content type)).
ORIGIN_FILES: dict[str, tuple[bytes, str]] = {
    "/img.png": (PNG, "image/png"),
    "/clip.wav": (WAV, "audio/wav"),
    "/clip.mp4": (MP4, "video/mp4"),
}
_ORIGIN_PATH = {"image": "/img.png", "audio": "/clip.wav", "video": "/clip.mp4"}
# Text that merely mentions URLs lives under /mention: never a media reference.
MENTION_PATH = "/mention"

# Error codes the gateway documents for a refusal (docs/gateway.md, docs/media.md).
STABLE_CODES = frozenset(
    {
        "invalid_request",
        "invalid_json",
        "field_not_allowed",
        "media_url_not_allowed",
        "media_invalid",
        "media_too_large",
        "media_duration_unknown",
        "media_fetch_failed",
        "request_too_large",
        "model_not_allowed",
        "model_not_found",
        "model_required",
        "unsupported_media_type",
    }
)

Json = Any
Path = tuple[str | int, ...]


def url(source: str, modality: str) -> str:
    if source == "origin":
        return ORIGIN + _ORIGIN_PATH[modality]
    if source == "canary":
        return CANARY + "/stolen-" + modality
    if source == "embeds":
        return ""
    return DATA[modality]


# --- part shapes --------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    modality: str
    build: Callable[[str], dict[str, Any]]
    families: frozenset[str]  # container families the shape is native to
    sources: tuple[str, ...] = ("origin", "canary", "data")
    engine_ok: bool = True  # a real vLLM 0.32 serves it (with a model of that modality)


# Families: "chat" (vLLM's chat parser: chat in every role, tokenize, invocations, pooling
# with messages), "responses" (message items and tool outputs become chat messages),
# (vLLM 0.32 validates /v1/responses items with openai's pydantic types: message and
# tool-output content takes `input_text` and `input_image` with `detail` only), "scoring"
# (ScoreContentPartParam: image_url, video_url, text), "cohere" (Cohere chat and
# /v2/embed inputs: image_url objects), "messages" (Anthropic blocks).
CHAT = frozenset({"chat"})
ALL_URL = frozenset({"chat", "scoring", "cohere"})
SCORING = frozenset({"chat", "scoring"})
RESPONSES = frozenset({"chat", "responses"})
SHAPES: tuple[Shape, ...] = (
    Shape("image_url", "image", lambda u: {"type": "image_url", "image_url": {"url": u}},
          ALL_URL),
    Shape("image_url_detail", "image",
          lambda u: {"type": "image_url", "image_url": {"url": u, "detail": "auto"}}, ALL_URL),
    Shape("image_url_uuid", "image",
          lambda u: {"type": "image_url", "image_url": {"url": u}, "uuid": "client-img-1"}, CHAT),
    # vLLM validates `image_url` as an object when `type` is set and no uuid is.
    Shape("image_url_bare_typed", "image", lambda u: {"type": "image_url", "image_url": u}, CHAT,
          engine_ok=False),
    Shape("image_url_bare", "image", lambda u: {"image_url": u}, CHAT),
    Shape("image_url_untyped", "image", lambda u: {"image_url": {"url": u}}, CHAT),
    Shape("input_image", "image",
          lambda u: {"type": "input_image", "image_url": u, "detail": "auto"}, RESPONSES),
    # Not a vLLM shape (ResponseInputImageParam.image_url is a string): odd, never legit.
    Shape("input_image_object", "image",
          lambda u: {"type": "input_image", "image_url": {"url": u}, "detail": "auto"},
          frozenset(), engine_ok=False),
    Shape("video_url", "video", lambda u: {"type": "video_url", "video_url": {"url": u}},
          SCORING),
    Shape("video_url_bare", "video", lambda u: {"video_url": u}, CHAT),
    Shape("audio_url", "audio", lambda u: {"type": "audio_url", "audio_url": {"url": u}}, CHAT),
    Shape("audio_url_bare", "audio", lambda u: {"audio_url": u}, CHAT),
    Shape("input_audio", "audio",
          lambda u: {"type": "input_audio", "input_audio": {"data": B64_WAV, "format": "wav"}},
          CHAT, sources=("data",)),
    Shape("anthropic_url", "image",
          lambda u: {"type": "image", "source": {"type": "url", "url": u}},
          frozenset({"messages"})),
    Shape("anthropic_base64", "image",
          lambda u: {"type": "image",
                     "source": {"type": "base64", "media_type": "image/png", "data": B64_PNG}},
          frozenset({"messages"}), sources=("data",)),
    # Embeds parts: vLLM torch-loads their bytes (CVE-2025-62164); refused by default,
    # wherever they sit and whatever else the part carries. Typed, and by key presence
    # (vLLM's fallback when `type` is missing or a `uuid` is set).
    *(Shape(name, "image", build, frozenset(), sources=("embeds",), engine_ok=False)
      for name, build in (
          ("image_embeds", lambda u: {"type": "image_embeds", "image_embeds": EMBEDS}),
          ("image_embeds_untyped", lambda u: {"image_embeds": EMBEDS}),
          ("image_embeds_dict_uuid",
           lambda u: {"image_embeds": {"image_embeds": EMBEDS}, "uuid": "u-3"}),
          ("audio_embeds", lambda u: {"type": "audio_embeds", "audio_embeds": EMBEDS}),
          ("video_embeds", lambda u: {"type": "video_embeds", "video_embeds": EMBEDS}),
          ("prompt_embeds_part", lambda u: {"type": "prompt_embeds", "data": EMBEDS}),
          ("prompt_embeds_untyped", lambda u: {"prompt_embeds": EMBEDS, "data": EMBEDS}),
      )),
)  # fmt: skip
SHAPE = {s.name: s for s in SHAPES}


# --- decorations on the media part --------------------------------------------------


def _set(key: str, value: Json) -> Callable[[dict[str, Any]], None]:
    def apply(part: dict[str, Any]) -> None:
        part[key] = copy.deepcopy(value)

    return apply


def _drop_type(part: dict[str, Any]) -> None:
    part.pop("type", None)


DECORATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "plain": lambda part: None,
    "uuid": _set("uuid", "client-uuid-7"),
    "role_user": _set("role", "user"),
    "role_null": _set("role", None),
    "role_assistant": _set("role", "assistant"),
    "role_tool": _set("role", "tool"),
    "role_number": _set("role", 1),
    "role_object": _set("role", {"role": "user"}),
    "name": _set("name", "alice"),
    "unknown_key": _set("x-extra", {"nested": [1, {"k": "v"}]}),
    "content_text": _set("content", "hello"),
    "content_parts": _set("content", [{"type": "text", "text": "hello"}]),
    "type_removed": _drop_type,
    "type_text": _set("type", "text"),
    "type_image": _set("type", "image"),
    "type_upper": _set("type", "IMAGE_URL"),
    "type_message": _set("type", "message"),
    "type_tool_output": _set("type", "function_call_output"),
    "type_list": _set("type", ["image_url"]),
    "type_object": _set("type", {"type": "image_url"}),
    "type_number": _set("type", 7),
    "type_null": _set("type", None),
    "role_and_uuid": lambda p: p.update(role="user", uuid="u-2"),
}
LEGIT_DECORATIONS = frozenset({"plain", "uuid"})
_TYPE_DECORATIONS = frozenset(d for d in DECORATIONS if d.startswith("type_"))


# --- nestings: where the part sits in its content list ------------------------------

TEXT = {"type": "text", "text": "What is in this picture?"}


def _flat(part: dict[str, Any]) -> Json:
    return [copy.deepcopy(TEXT), part]


NESTINGS: dict[str, Callable[[dict[str, Any]], Json]] = {
    "flat": _flat,
    "twice": lambda p: [p, copy.deepcopy(TEXT), copy.deepcopy(p)],
    "in_list": lambda p: [copy.deepcopy(TEXT), [p]],
    "in_object": lambda p: [copy.deepcopy(TEXT), {"wrapper": p}],
    "deep": lambda p: [copy.deepcopy(TEXT), {"a": [{"b": {"c": [[{"d": p}]]}}]}],
    "as_object": lambda p: p,  # content is the part itself, not a list
    "under_content": lambda p: [{"content": [p]}],
    # "on_message": the part's keys on the message dict itself (handled by containers)
    "on_message": _flat,
}
LEGIT_NESTINGS = frozenset({"flat", "twice"})


# --- containers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Container:
    name: str
    route: str
    family: str
    # Builds the body from a content value (a list of parts, or odd nestings); `message`
    # gets extra keys merged into the message that holds the content ("on_message").
    build: Callable[[Json, dict[str, Any]], dict[str, Any]]
    runner: str = "generate"  # the engine kind that serves it
    legit: bool = True  # its body shape is one vLLM documents for that route
    engine_ok: bool = True  # the real tier's engine serves the route


def _chat_body(role: str, **extra: Any) -> Callable[[Json, dict[str, Any]], dict[str, Any]]:
    def build(content: Json, on_message: dict[str, Any]) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        if role == "tool":
            messages.append({"role": "user", "content": "call the tool"})
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call-1",
                            "type": "function",
                            "function": {"name": "look", "arguments": "{}"},
                        }
                    ],
                }
            )
        msg: dict[str, Any] = {"role": role, "content": content, **on_message}
        if role == "tool":
            msg["tool_call_id"] = "call-1"
        messages.append(msg)
        if role != "user":
            messages.append({"role": "user", "content": "describe it"})
        return {"model": MODEL, "messages": messages, **extra}

    return build


def _messages_body(content: Json, on_message: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content, **on_message}]


def _batch(content: Json, on_message: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [[{"role": "user", "content": "hi"}], _messages_body(content, on_message)],
    }


def _responses_text(content: Json) -> Json:
    """The Responses API's text part is `input_text`."""
    if isinstance(content, list):
        return [{"type": "input_text", "text": p["text"]} if p == TEXT else p for p in content]
    return content


# The Responses API's tool calls, by type: what each carries besides its id and name.
_TOOL_CALLS: dict[str, dict[str, str]] = {
    "function_call": {"arguments": "{}"},
    "custom_tool_call": {"input": "x"},
}


def _responses(kind: str) -> Callable[[Json, dict[str, Any]], dict[str, Any]]:
    def build(content: Json, on_message: dict[str, Any]) -> dict[str, Any]:
        content = _responses_text(content)
        items: list[dict[str, Any]]
        if kind == "message":
            items = [{"role": "user", "content": content, **on_message}]
        elif kind == "typed_message":
            items = [{"type": "message", "role": "user", "content": content, **on_message}]
        else:  # a tool's output: the call, then its output holding the content
            call_type = kind.removesuffix("_output")
            call = _TOOL_CALLS[call_type]
            items = [
                {"role": "user", "content": "call the tool"},
                {"type": call_type, "call_id": "call-1", "name": "look", **call},
                {"type": kind, "call_id": "call-1", "output": content, **on_message},
            ]
        return {"model": MODEL, "max_output_tokens": 16, "input": items}

    return build


def _anthropic(kind: str, route: str) -> Callable[[Json, dict[str, Any]], dict[str, Any]]:
    def build(content: Json, on_message: dict[str, Any]) -> dict[str, Any]:
        if kind == "user":
            messages = [{"role": "user", "content": content, **on_message}]
        elif kind == "assistant":
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": content, **on_message},
                {"role": "user", "content": "describe it"},
            ]
        else:  # tool_result in a user turn
            messages = [
                {"role": "user", "content": "call the tool"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "tu-1", "name": "look", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "tu-1",
                            "content": content,
                            **on_message,
                        }
                    ],
                },
            ]
        body: dict[str, Any] = {"model": MODEL, "messages": messages}
        if route == "/v1/messages":
            body["max_tokens"] = 2
        return body

    return build


def _scoring(route: str, where: str) -> Callable[[Json, dict[str, Any]], dict[str, Any]]:
    def build(content: Json, on_message: dict[str, Any]) -> dict[str, Any]:
        mm = {"content": content, **on_message}
        if where == "queries":
            return {"model": MODEL, "queries": mm, "documents": ["a document"]}
        if where == "documents":
            return {"model": MODEL, "queries": "a query", "documents": mm}
        if where == "text_2":
            return {"model": MODEL, "text_1": "a query", "text_2": mm}
        if where == "items":
            return {"model": MODEL, "queries": "a query", "items": [mm]}
        if where == "data_1":
            return {"model": MODEL, "data_1": [mm], "data_2": "a document"}
        if where == "rerank":
            return {"model": MODEL, "query": "a query", "documents": mm}
        return {
            "model": MODEL,
            "inputs": [mm],
            "input_type": "image",
            "embedding_types": ["float"],
        }  # /v2/embed

    return build


def _messages(name: str, route: str, role: str) -> Container:
    """An Anthropic Messages body on one of its routes."""
    return Container(name, route, "messages", _anthropic(role, route))


def _scored(name: str, route: str, field: str, family: str = "scoring") -> Container:
    """A scoring, rerank or embed body on one of its routes (a pooling engine serves it)."""
    return Container(name, route, family, _scoring(route, field), runner="pooling")


CONTAINERS: tuple[Container, ...] = (
    *(Container(f"chat_{role}", "/v1/chat/completions", "chat",
                _chat_body(role, max_tokens=2))
      for role in ("user", "system", "assistant", "tool", "developer", "narrator")),
    Container("chat_stream", "/v1/chat/completions", "chat",
              _chat_body("user", max_tokens=2, stream=False, n=1)),
    Container("tokenize", "/tokenize", "chat", _chat_body("user")),
    Container("invocations_chat", "/invocations", "chat", _chat_body("user", max_tokens=2)),
    Container("invocations_pooling", "/invocations", "chat",
              _chat_body("user", encoding_format="float"), runner="pooling"),
    Container("batch_chat", "/v1/chat/completions/batch", "chat", _batch),
    Container("embeddings", "/v1/embeddings", "chat", _chat_body("user"), runner="pooling"),
    Container("pooling", "/pooling", "chat", _chat_body("user"), runner="pooling"),
    Container("classify", "/classify", "chat", _chat_body("user"), runner="pooling"),
    # vLLM 0.32 serves /cohere/v2/chat only when enabled (404 on the real tier's engine).
    Container("cohere_chat", "/cohere/v2/chat", "cohere", _chat_body("user"), engine_ok=False),
    Container("responses_message", "/v1/responses", "responses", _responses("message")),
    Container("responses_typed_message", "/v1/responses", "responses",
              _responses("typed_message")),
    Container("responses_function_output", "/v1/responses", "responses",
              _responses("function_call_output")),
    Container("responses_custom_tool_output", "/v1/responses", "responses",
              _responses("custom_tool_call_output")),
    _messages("messages_user", "/v1/messages", "user"),
    _messages("messages_assistant", "/v1/messages", "assistant"),
    _messages("messages_tool_result", "/v1/messages", "tool_result"),
    _messages("count_tokens", "/v1/messages/count_tokens", "user"),
    _messages("count_tokens_tool_result", "/v1/messages/count_tokens", "tool_result"),
    _scored("score_queries", "/score", "queries"),
    _scored("score_documents", "/v1/score", "documents"),
    _scored("score_text_2", "/score", "text_2"),
    _scored("score_items", "/score", "items"),
    _scored("score_data_1", "/v1/score", "data_1"),
    _scored("rerank", "/rerank", "rerank"),
    _scored("rerank_v1", "/v1/rerank", "rerank"),
    _scored("rerank_v2", "/v2/rerank", "rerank"),
    _scored("embed_v2_inputs", "/v2/embed", "embed", family="cohere"),
    # Every other JSON route once: the walk must not depend on the route.
    Container("completions_messages", "/v1/completions", "chat",
              _chat_body("user", prompt="hi", max_tokens=2), legit=False),
    Container("detokenize_messages", "/detokenize", "chat", _chat_body("user", tokens=[1, 2]),
              legit=False),
    Container("generative_scoring_messages", "/generative_scoring", "chat",
              _chat_body("user"), legit=False),
    Container("v2_embed_messages", "/v2/embed", "chat", _chat_body("user"), runner="pooling",
              legit=False),
)  # fmt: skip
CONTAINER = {c.name: c for c in CONTAINERS}


# --- cases --------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    route: str
    body: dict[str, Any]
    evil: bool  # the canary in a media position, or an embeds part: must be refused
    legit: bool  # a documented shape with allowed media or mere mentions: must be served
    runner: str = "generate"
    modalities: frozenset[str] = frozenset()
    engine_ok: bool = False  # a real vLLM 0.32 multimodal engine serves it as well
    media: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.media = media_paths(self.body)


def _source_placed(shape: Shape, source: str) -> str:
    return url(source, shape.modality)


def make(
    container: str, shape: str, source: str, decoration: str = "plain", nesting: str = "flat"
) -> Case:
    c, s = CONTAINER[container], SHAPE[shape]
    part = s.build(_source_placed(s, source))
    DECORATIONS[decoration](part)
    if nesting == "on_message":
        content: Json = "describe the attached media"
        on_message = part
    else:
        content = NESTINGS[nesting](part)
        on_message = {}
    body = c.build(content, on_message)
    native = c.family in s.families
    legit = (
        source != "canary"
        and c.legit
        and native
        and decoration in LEGIT_DECORATIONS
        and nesting in LEGIT_NESTINGS
    )
    engine_ok = (
        legit and c.engine_ok and s.engine_ok and nesting == "flat" and (decoration == "plain")
    )
    return Case(
        f"{container}/{shape}/{source}/{decoration}/{nesting}",
        c.route,
        body,
        # A prompt_embeds part is one by its `type` alone: with another type it is data.
        evil=source == "canary"
        or (
            source == "embeds"
            and not (shape == "prompt_embeds_part" and decoration in _TYPE_DECORATIONS)
        ),
        legit=legit,
        runner=c.runner,
        modalities=frozenset({s.modality}),
        engine_ok=engine_ok,
    )


def embed_images_cases() -> list[Case]:
    """/v2/embed `images`: a list of URL strings (Cohere's shape), and odd variants."""
    out: list[Case] = []
    for source in ("origin", "canary", "data"):
        u = url(source, "image")
        variants: list[tuple[str, Json, bool]] = [
            ("list", [u], True),
            ("two", [DATA["image"], u], True),
            ("string", u, False),
            ("objects", [{"url": u}], False),
            ("image_url_objects", [{"image_url": {"url": u}}], False),
            ("nested", [[u]], False),
        ]
        for name, images, documented in variants:
            body = {"model": MODEL, "images": images, "input_type": "image",
                    "embedding_types": ["float"]}  # fmt: skip
            out.append(Case(f"embed_v2_images/{name}/{source}", "/v2/embed", body,
                            evil=source == "canary", legit=documented and source != "canary",
                            runner="pooling", modalities=frozenset({"image"})))  # fmt: skip
    return out


def mention_cases() -> list[Case]:
    """Legitimate bodies whose only URLs are text: prose, a bare URL as the whole text,
    tool schemas with a parameter named like a media key, tool-call arguments, a
    response schema. Each must be served, with its text unchanged."""
    canary = CANARY + MENTION_PATH + "/a.png"
    origin = ORIGIN + MENTION_PATH + "/b.png"
    prose = f"Compare {canary} with {origin}, then answer."
    tool = {"type": "function", "function": {
        "name": "fetch_image", "description": f"Fetches an image such as {canary}",
        "parameters": {"type": "object", "properties": {
            "image_url": {"type": "string", "description": "the image URL"},
            "url": {"type": "string", "description": f"for example {origin}"},
            "source": {"type": "object", "properties": {"url": {"type": "string"}}}},
            "required": ["image_url"]}}}  # fmt: skip
    cases: list[tuple[str, str, dict[str, Any], bool]] = [
        ("chat_prose", "/v1/chat/completions",
         {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": prose}]},
         True),
        ("chat_text_part", "/v1/chat/completions",
         {"model": MODEL, "max_tokens": 2, "messages": [
             {"role": "user", "content": [{"type": "text", "text": prose}]}]}, True),
        ("chat_text_is_url", "/v1/chat/completions",
         {"model": MODEL, "max_tokens": 2, "messages": [
             {"role": "user", "content": [{"type": "text", "text": canary}]}]}, True),
        ("chat_system_prose", "/v1/chat/completions",
         {"model": MODEL, "max_tokens": 2, "messages": [
             {"role": "system", "content": prose}, {"role": "user", "content": "hi"}]}, True),
        ("chat_tool_schema", "/v1/chat/completions",
         {"model": MODEL, "max_tokens": 2, "tools": [tool], "tool_choice": "none",
          "messages": [{"role": "user", "content": "show me a cat"}]}, True),
        ("chat_tool_call_arguments", "/v1/chat/completions",
         {"model": MODEL, "max_tokens": 2, "tools": [tool], "tool_choice": "none", "messages": [
             {"role": "user", "content": "show me a cat"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call-1", "type": "function", "function": {
                     "name": "fetch_image",
                     "arguments": json.dumps({"image_url": canary, "url": origin})}}]},
             {"role": "tool", "tool_call_id": "call-1", "content": f"fetched {canary}"},
             {"role": "user", "content": "and?"}]}, True),
        ("chat_response_format", "/v1/chat/completions",
         {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": prose}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "img", "schema": {
              "type": "object", "properties": {"image_url": {"type": "string"}}}}}}, False),
        ("completions_prompt", "/v1/completions",
         {"model": MODEL, "max_tokens": 2, "prompt": prose}, True),
        ("tokenize_prompt", "/tokenize", {"model": MODEL, "prompt": prose}, True),
        ("tokenize_messages", "/tokenize",
         {"model": MODEL, "messages": [{"role": "user", "content": prose}]}, True),
        ("invocations_prompt", "/invocations",
         {"model": MODEL, "max_tokens": 2, "prompt": prose}, True),
        ("responses_text", "/v1/responses", {"model": MODEL, "input": prose}, True),
        ("responses_input_text", "/v1/responses",
         {"model": MODEL, "input": [{"role": "user", "content": [
             {"type": "input_text", "text": prose}]}]}, True),
        ("responses_function_output_text", "/v1/responses",
         {"model": MODEL, "input": [
             {"role": "user", "content": "call the tool"},
             {"type": "function_call", "call_id": "call-1", "name": "look",
              "arguments": json.dumps({"url": canary})},
             {"type": "function_call_output", "call_id": "call-1", "output": prose}]}, True),
        ("messages_text", "/v1/messages",
         {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
             {"type": "text", "text": prose}]}]}, True),
        ("messages_tool_result_text", "/v1/messages",
         {"model": MODEL, "max_tokens": 2, "messages": [
             {"role": "user", "content": "call the tool"},
             {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "tu-1", "name": "look", "input": {"url": canary}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu-1",
                                           "content": [{"type": "text", "text": prose}]}]}]},
         True),
        ("embeddings_input", "/v1/embeddings", {"model": MODEL, "input": [prose, canary]}, False),
        ("score_text", "/score", {"model": MODEL, "queries": prose, "documents": [canary]},
         False),
        ("rerank_text", "/rerank", {"model": MODEL, "query": prose, "documents": [canary]},
         False),
        ("cohere_chat_text", "/cohere/v2/chat",
         {"model": MODEL, "messages": [{"role": "user", "content": prose}]}, False),
    ]  # fmt: skip
    out = []
    for name, route, body, generate in cases:
        out.append(Case(f"mention/{name}", route, body, evil=False, legit=True,
                        runner="generate" if generate else "pooling",
                        engine_ok=generate))  # fmt: skip
    return out


def data_cases(containers: Sequence[Container] = CONTAINERS) -> list[Case]:
    """Inline data in native shapes: every data shape in the main container of each family,
    one shape (round robin) in every other container. Must be served."""
    main = {"chat_user", "responses_message", "responses_custom_tool_output", "messages_user",
            "messages_tool_result", "score_queries"}  # fmt: skip
    out = []
    k = 0
    for c in containers:
        native = [s for s in SHAPES if "data" in s.sources and c.family in s.families]
        if not (native and c.legit):
            continue
        if c.name in main:
            out += [make(c.name, s.name, "data") for s in native]
        else:
            out.append(make(c.name, native[k % len(native)].name, "data"))
            k += 1
    return out


_VALUE_KEYS = ("image_url", "video_url", "audio_url", "input_audio", "source")
VALUE_WRAPS: dict[str, Callable[[Json], Json]] = {
    "value_in_list": lambda v: [v],
    "value_in_object": lambda v: {"content": v},
    "value_copied": lambda v: {**v, "copy": copy.deepcopy(v)} if isinstance(v, dict) else v,
}


def value_cases() -> list[Case]:
    """The value under the media key itself reshaped: wrapped in a list or an object, or
    carrying a copy of itself under an unknown key. vLLM reads none of these URLs; the
    brief's invariant is that no URL to the origin or the canary reaches the engine."""
    out = []
    for container, shape in [
        ("chat_user", "image_url"), ("chat_user", "video_url"), ("chat_user", "audio_url"),
        ("chat_user", "input_image_object"), ("responses_custom_tool_output", "image_url"),
        ("score_queries", "image_url"), ("messages_user", "anthropic_url"),
        ("messages_tool_result", "anthropic_url"),
    ]:  # fmt: skip
        for source in ("canary", "origin"):
            for how, wrap in VALUE_WRAPS.items():
                case = make(container, shape, source)
                part = get(case.body, next(iter(_part_paths(case.body))))
                key = next(k for k in _VALUE_KEYS if k in part)
                part[key] = wrap(part[key])
                out.append(Case(f"{case.id[: case.id.rindex('/')]}/{how}", case.route, case.body,
                                evil=case.evil, legit=False, runner=case.runner,
                                modalities=case.modalities))  # fmt: skip
    return out


def _part_paths(body: Json) -> list[Path]:
    """The objects holding a media key, found from the media values."""
    out = []
    for p in media_paths(body):
        i = max((j for j in range(len(p)) if p[j] in _VALUE_KEYS), default=len(p) - 1)
        if p[:i] not in out:
            out.append(p[:i])
    return out


def full_grammar() -> Iterator[Case]:
    """Every combination (a quarter of a million): the slices below pick from it."""
    for c in CONTAINERS:
        for s in SHAPES:
            for source in s.sources:
                for d in DECORATIONS:
                    for n in NESTINGS:
                        yield make(c.name, s.name, source, d, n)


def grammar_size() -> int:
    per_shape = sum(len(s.sources) for s in SHAPES)
    return len(CONTAINERS) * per_shape * len(DECORATIONS) * len(NESTINGS)


_URL_SHAPES = [s for s in SHAPES if "canary" in s.sources]


def fast_slice() -> list[Case]:
    """A deterministic slice of several hundred cases, a Latin-square walk over the
    grammar: every container meets a third of the shapes, a quarter of the decorations
    and half of the nestings (shifted per container, so each value meets containers of
    every family), each with the canary, and with the origin where the shape is native;
    plus every legitimate data shape, /v2/embed `images` and the mention bodies."""
    out: dict[str, Case] = {}

    def add(case: Case) -> None:
        out.setdefault(case.id, case)

    decorations = list(DECORATIONS)
    nestings = list(NESTINGS)
    for i, c in enumerate(CONTAINERS):
        for j, s in enumerate(_URL_SHAPES):
            if (i + j) % 3 == 0:
                add(make(c.name, s.name, "canary"))
                if c.family in s.families:
                    add(make(c.name, s.name, "origin"))
        for j, d in enumerate(decorations):
            if (i + j) % 4 == 0:
                s = _URL_SHAPES[(i + 2 * j) % len(_URL_SHAPES)]
                add(make(c.name, s.name, "canary", d))
                if (i + j) % 8 == 0:
                    add(make(c.name, s.name, "origin", d))
        for j, n in enumerate(nestings):
            if (i + j) % 2 == 0:
                s = _URL_SHAPES[(3 * i + j) % len(_URL_SHAPES)]
                add(make(c.name, s.name, "canary", "role_null" if j % 4 == 0 else "plain", n))
            elif (i + j) % 4 == 1:
                add(make(c.name, "image_url", "origin", "role_user", n))
    embeds = [s for s in SHAPES if "embeds" in s.sources]
    for i, c in enumerate(CONTAINERS):
        for j, s in enumerate(embeds):
            if (i + j) % 3 == 0:
                add(make(c.name, s.name, "embeds", decorations[(i + 5 * j) % len(decorations)],
                         nestings[(i + j) % len(nestings)]))  # fmt: skip
    for case in [*data_cases(), *embed_images_cases(), *mention_cases(), *value_cases()]:
        add(case)
    return list(out.values())


def real_slice() -> list[Case]:
    """For a real multimodal (image) engine with the generate runner: every legitimate
    image body it serves (every container, shape and source), and canary bodies on every
    route it serves: every decoration x nesting in the three containers where vLLM reads
    parts most deeply, every decoration and every nesting in all the others, so a canary
    contact by the real fetcher would show."""
    out: dict[str, Case] = {}

    def add(case: Case) -> None:
        if case.runner == "generate" and not (case.modalities - {"image"}):
            out.setdefault(case.id, case)

    deep = {"chat_user": "image_url", "responses_custom_tool_output": "input_image",
            "messages_tool_result": "anthropic_url"}  # fmt: skip
    for i, c in enumerate(CONTAINERS):
        if c.runner != "generate":
            continue
        for s in SHAPES:
            if s.modality == "image":
                for source in s.sources:
                    case = make(c.name, s.name, source)
                    if case.engine_ok or source == "canary":
                        add(case)
        native = [s for s in _URL_SHAPES if s.modality == "image" and c.family in s.families]
        for j, d in enumerate(DECORATIONS):
            for k, n in enumerate(NESTINGS):
                if c.name in deep:
                    add(make(c.name, deep[c.name], "canary", d, n))
                elif k == 0 or j == 0:
                    s = native[(i + j + k) % len(native)] if native else SHAPE["image_url"]
                    add(make(c.name, s.name, "canary", d, n))
    for case in [*fast_slice(), *mention_cases()]:
        if case.evil or case.engine_ok:
            add(case)
    return list(out.values())


# --- placeholders, paths, invariants ------------------------------------------------


@dataclass(frozen=True)
class Fill:
    """Replaces the placeholders with loopback base URLs (`http://127.0.0.1:PORT`) and the
    model name."""

    origin: str
    canary: str
    model: str

    def __call__(self, text: str) -> str:
        return (
            text.replace(ORIGIN, self.origin).replace(CANARY, self.canary)
            .replace(MODEL, self.model)
        )  # fmt: skip

    def body(self, body: Json) -> bytes:
        """The body as bytes to send."""
        return self(json.dumps(body)).encode()

    def urls(self) -> re.Pattern[str]:
        """A string that is a URL to the origin or the canary (not one that mentions it)."""
        alts = "|".join(re.escape(b.split("://", 1)[1]) for b in (self.origin, self.canary))
        return re.compile(rf"\s*https?://(?:{alts})(?:[/?]\S*)?\s*", re.IGNORECASE)


def walk(value: Json, path: Path = ()) -> Iterator[tuple[Path, Json]]:
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from walk(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk(v, (*path, i))


_MEDIA_VALUES = frozenset({*DATA.values(), B64_PNG, B64_WAV})


def is_media_value(value: Json) -> bool:
    if not isinstance(value, str):
        return False
    if value in _MEDIA_VALUES:
        return True
    return (value.startswith((ORIGIN, CANARY))) and MENTION_PATH not in value


def media_paths(body: Json) -> list[Path]:
    """Where media references sit in a (placeholder) body: URL placeholders, data URLs
    and inline base64 payloads, found by value."""
    return [p for p, v in walk(body) if is_media_value(v)]


def get(body: Json, path: Path) -> Json:
    for key in path:
        body = body[key]
    return body


def _find(body: Json, path: Path) -> Json:
    try:
        return get(body, path)
    except (KeyError, IndexError, TypeError):
        return None


def _is_base64(value: Json) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        base64.b64decode(value, validate=True)
    except ValueError:
        return False
    return True


def in_media_position(body: Json, path: Path) -> bool:
    """Whether a value sits where the documented rules (docs/media.md) make it media:
    below a media key or a `source`, or inside an object typed as a media part. A URL
    elsewhere (an annotation's `url`, an unknown field) is read by no vLLM 0.32 code
    (tests/real/test_vllm_shapes.py keeps these tables honest) and is not media."""
    node = body
    for key in path:
        if isinstance(node, dict):
            ptype = node.get("type")
            if (
                key in MEDIA_KEYS
                or key == "source"
                or (isinstance(ptype, str) and ptype in MEDIA_TYPES)
            ):
                return True
        node = node[key]
    return False


@dataclass
class Outcome:
    status: int
    error_code: str | None
    forwarded: list[tuple[str, bytes]]  # what the engine received for this request


def check(
    case_id: str,
    route: str,
    body: Json,
    evil: bool,
    legit: bool,
    outcome: Outcome,
    *,
    urls: re.Pattern[str],
    fill: Callable[[str], str],
    canary_contacts: int,
    engine_path: str | None = None,
    require_single_forward: bool = True,
) -> None:
    """The invariants for one generated body sent through the gateway:
    1. the canary was never contacted;
    2. the answer is 2xx, or 4xx with a documented error code; never 5xx;
    3. a body with the canary in a media position is refused, and nothing reached the
       engine;
    4. a forwarded body holds no string that is a URL to the origin or the canary in a
       media position (`in_media_position`: below a media key or a `source`, or in an
       object typed as a media part), each media path there now holds a `data:` URL (or
       inline base64 where the source was base64, or a base64 `source` where it was an
       Anthropic URL source), and text mentions are unchanged;
    5. a legitimate body is served (200)."""
    where = f"{case_id} {route} -> {outcome.status} {outcome.error_code}"
    assert canary_contacts == 0, f"{where}: the canary was contacted"
    assert 200 <= outcome.status < 300 or 400 <= outcome.status < 500, f"{where}: not 2xx/4xx"
    if outcome.status >= 400:
        assert outcome.error_code in STABLE_CODES, f"{where}: error code not a documented one"
        assert not outcome.forwarded, f"{where}: refused, yet the engine received it"
    assert not (evil and outcome.status < 400), (
        f"{where}: must be refused (canary in a media position, or an embeds part), yet "
        "forwarded: "
        + (outcome.forwarded[0][1][:600].decode(errors="replace") if outcome.forwarded else "")
    )
    assert not (legit and outcome.status != 200), f"{where}: a legitimate body was not served"
    if outcome.status >= 400:
        return
    if require_single_forward:
        assert len(outcome.forwarded) == 1, f"{where}: engine received {len(outcome.forwarded)}"
    for path, raw in outcome.forwarded:
        if engine_path is not None:
            assert path == engine_path, f"{where}: forwarded to {path}"
        sent = json.loads(raw)
        leaks = [
            (p, v)
            for p, v in walk(sent)
            if isinstance(v, str)
            and urls.fullmatch(v)
            and MENTION_PATH not in v
            and in_media_position(sent, p)
        ]
        assert not leaks, f"{where}: URLs reached the engine: {leaks[:3]}"
        for p in media_paths(body):
            if not in_media_position(body, p):
                continue  # moved where nothing reads media: checked by `leaks` above
            original = get(body, p)
            try:
                now = get(sent, p)
            except (KeyError, IndexError, TypeError):
                # An Anthropic URL source becomes a base64 source.
                parent = _find(sent, p[:-1])
                if isinstance(parent, dict) and parent.get("type") == "base64":
                    assert _is_base64(parent.get("data")), f"{where}: {p[:-1]} data not base64"
                    continue
                # Dropped: an odd body may lose what the gateway did not check (nothing
                # unchecked is forwarded); a legitimate one keeps every media item.
                assert not legit, f"{where}: media at {p} is gone and not inlined"
                continue
            if isinstance(original, str) and original.startswith(("data:", ORIGIN, CANARY)):
                assert isinstance(now, str) and now.startswith("data:"), (
                    f"{where}: media at {p} is {now!r:.120}, not a data: URL"
                )
            else:
                assert _is_base64(now), f"{where}: inline data at {p} is not base64"
        for part_path in _part_paths(body):
            uuid = (
                get(body, part_path).get("uuid") if isinstance(get(body, part_path), dict) else None
            )
            if uuid is not None:
                sent_part = _find(sent, part_path)
                now = sent_part.get("uuid") if isinstance(sent_part, dict) else None
                assert now is None or now != uuid, (
                    f"{where}: the client's uuid {uuid!r} at {part_path} reached the engine as sent"
                )
        for p, v in walk(body):
            if isinstance(v, str) and MENTION_PATH in v:
                try:
                    now = get(sent, p)
                except (KeyError, IndexError, TypeError):
                    raise AssertionError(f"{where}: text at {p} was removed") from None
                assert now == fill(v), f"{where}: text at {p} changed"


def ids(cases: Sequence[Case]) -> list[str]:
    return [c.id for c in cases]
