"""Inspecting JSON request bodies: dangerous fields, media references, client uuids.

The proxy calls this once per JSON request, after auth and the model check:

    inspector = PayloadInspector(settings.media)          # once per app (lifespan)
    hashes = await inspector.inspect(path, body, key_name=key.name)
    ...
    await inspector.aclose()                               # at shutdown

`inspect` mutates `body` in place and returns the content hashes of its media items in
request order (for routing). It raises `GatewayError` subclasses: `FieldNotAllowed`,
`InvalidRequest` (cache_salt, nesting), `MediaUrlNotAllowed`, `MediaFetchFailed`,
`MediaInvalid`, `MediaTooLarge`. Every URL is checked before anything is fetched, so a
refused request makes no outbound connection.

The walker is deliberately shape-tolerant. vLLM's `/invocations` dispatches on body keys
and vLLM picks a content part's type by key presence when `type` is missing or a `uuid`
is set (VLLM-FACTS.md), so every known media location is walked on every path, and a
content part carrying any URL-like key is media even when its shape is unknown: it is
checked against the URL policy and then refused, never ignored. `path` is accepted for
the proxy's convenience and future per-endpoint rules.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.errors import (
    FieldNotAllowed,
    InvalidRequest,
    MediaInvalid,
    MediaTooLarge,
    MediaUrlNotAllowed,
)
from gateway.media.av import audio_type
from gateway.media.fetch import MediaFetcher, Resolver
from gateway.media.images import check_formats
from gateway.media.inline import MediaInliner, MediaKind, Resolved
from gateway.media.settings import MediaMode, MediaSettings, UuidPolicy
from gateway.media.urls import DataUrl, RemoteUrl, UrlPolicy

# Top-level fields refused unless the named setting opts in (VLLM-FACTS.md: torch
# deserialization, engine connection steering, processor and template control).
_FORBIDDEN_FIELDS: dict[str, str] = {
    "prompt_embeds": "allow_prompt_embeds",
    "kv_transfer_params": "allow_kv_transfer_params",
    "ec_transfer_params": "allow_ec_transfer_params",
    "media_io_kwargs": "allow_media_io_kwargs",
    "mm_processor_kwargs": "allow_mm_processor_kwargs",
    "chat_template": "allow_chat_template",
}
# Content parts that make vLLM torch.load client bytes (CVE-2025-62164 and follow-ups).
_EMBEDS_PARTS = ("image_embeds", "audio_embeds", "video_embeds")

# Keys that make a content part media. The first group has a known kind.
_KIND_BY_KEY: dict[str, MediaKind] = {
    "image_url": MediaKind.image,
    "input_image": MediaKind.image,
    "image": MediaKind.image,
    "image_pil": MediaKind.image,
    "video_url": MediaKind.video,
    "video": MediaKind.video,
    "audio_url": MediaKind.audio,
    "audio": MediaKind.audio,
    "input_audio": MediaKind.audio,
}
_URLISH_KEYS = frozenset(
    {*_KIND_BY_KEY, "url", "uri", "src", "href", "source", "file", "file_url", "file_data",
     "file_id", "multi_modal_data", "multi_modal_uuids"}
)  # fmt: skip

# Top-level lists of URLs (/v1/systemone, /v2/embed `images`).
_URL_LISTS: dict[str, MediaKind] = {
    "images": MediaKind.image,
    "audio": MediaKind.audio,
    "audios": MediaKind.audio,
    "videos": MediaKind.video,
    "video": MediaKind.video,
}
# Top-level fields that hold messages, items, parts or scoring inputs.
_CONTAINERS = (
    "messages", "input", "inputs", "system", "prompt", "query", "queries", "documents",
    "text_1", "text_2", "data_1", "data_2", "items",
)  # fmt: skip
_MAX_DEPTH = 32


@dataclass
class _Slot:
    param: str
    kind: MediaKind
    ref: RemoteUrl | DataUrl | None = None
    raw: tuple[bytes, str | None] | None = None  # inline bytes and declared type
    apply: Callable[[Resolved], None] | None = None
    fixed: str | None = None  # identity of a uuid-only reference


def _b64(value: object, param: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise MediaInvalid("The inline media data is missing.", param=param)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MediaInvalid("The inline media data is not valid base64.", param=param) from None


class _Walker:
    def __init__(self, settings: MediaSettings, policy: UrlPolicy, key_name: str) -> None:
        self.settings = settings
        self.policy = policy
        self.key_name = key_name
        self.slots: list[_Slot] = []

    # --- top level -------------------------------------------------------------------

    def body(self, body: dict[str, Any]) -> None:
        for field, setting in _FORBIDDEN_FIELDS.items():
            if body.get(field) is not None and not getattr(self.settings, setting):
                raise FieldNotAllowed(f"The field '{field}' is not allowed.", param=field)
        kwargs = body.get("chat_template_kwargs")
        if (
            isinstance(kwargs, dict)
            and kwargs.get("chat_template") is not None
            and not self.settings.allow_chat_template
        ):
            raise FieldNotAllowed(
                "The field 'chat_template' is not allowed.",
                param="chat_template_kwargs.chat_template",
            )
        salt = body.get("cache_salt")
        if salt is not None and (
            not isinstance(salt, str) or len(salt) > self.settings.max_cache_salt_length
        ):
            raise InvalidRequest("cache_salt is not a string or is too long.", param="cache_salt")
        for key in _CONTAINERS:
            if key in body:
                self.node(body[key], key, 0)
        for key, kind in _URL_LISTS.items():
            value = body.get(key)
            if isinstance(value, str):
                self.url(value, kind, key, self._setter(body, key))
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, str):
                        self.url(item, kind, f"{key}[{i}]", self._setter(value, i))
                    elif item is not None:
                        self.part_like({"url": item}, f"{key}[{i}]", kind)
        if len(self.slots) > self.settings.max_items:
            raise MediaTooLarge("The request carries more media items than this gateway accepts.")

    # --- containers ------------------------------------------------------------------

    def node(self, value: object, param: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise InvalidRequest("The request body is nested too deeply.", param=param)
        if isinstance(value, list):
            for i, item in enumerate(value):
                self.node(item, f"{param}[{i}]", depth + 1)
            return
        if not isinstance(value, dict):
            return
        content = value.get("content")
        if isinstance(content, list | dict):
            self.node(content, f"{param}.content", depth + 1)
        if value.get("type") == "function_call_output" and isinstance(value.get("output"), list):
            self.node(value["output"], f"{param}.output", depth + 1)
        if "role" not in value:  # a message's own keys never fetch; its parts do
            self.part(value, param)

    # --- content parts ---------------------------------------------------------------

    def part(self, part: dict[str, Any], param: str) -> None:
        ptype = part.get("type")
        if not self.settings.allow_embeds_parts:
            for key in _EMBEDS_PARTS:
                if ptype == key or key in part:
                    raise FieldNotAllowed(f"The content part '{key}' is not allowed.", param=param)
        if (ptype == "prompt_embeds" or "prompt_embeds" in part) and not (
            self.settings.allow_prompt_embeds
        ):
            raise FieldNotAllowed("The content part 'prompt_embeds' is not allowed.", param=param)
        before = len(self.slots)
        for key in [k for k in part if k in _URLISH_KEYS]:
            self.media(part, key, ptype, f"{param}.{key}")
        if "uuid" in part:
            self.uuid(part, param, has_media=len(self.slots) > before)

    def part_like(self, part: dict[str, Any], param: str, kind: MediaKind) -> None:
        value = part["url"]
        if isinstance(value, dict) and isinstance(value.get("url"), str):
            self.url(value["url"], kind, param, self._setter(value, "url"))
        else:
            raise MediaInvalid("The media item's shape is not recognised.", param=param)

    def media(self, part: dict[str, Any], key: str, ptype: object, param: str) -> None:
        value = part[key]
        if value is None:
            return  # vLLM skips empty media; a uuid alone is handled by `uuid`
        kind = _KIND_BY_KEY.get(key) or _kind_from_type(ptype)
        if key == "input_audio":
            if not isinstance(value, dict):
                raise MediaInvalid("input_audio must be an object.", param=param)
            declared = audio_type(value.get("format"))
            if declared is None:
                raise MediaInvalid("The input_audio format is not allowed.", param=param)
            data = _b64(value.get("data"), f"{param}.data")

            def set_audio(r: Resolved, value: dict[str, Any] = value) -> None:
                value["data"] = r.base64

            self.slots.append(_Slot(param, MediaKind.audio, raw=(data, declared), apply=set_audio))
            return
        if key == "source" and isinstance(value, dict):
            self.source(value, part, kind, param)
            return
        if isinstance(value, str):
            self.url(value, kind, param, self._setter(part, key))
        elif isinstance(value, dict) and isinstance(value.get("url"), str):
            self.url(value["url"], kind, f"{param}.url", self._setter(value, "url"))
        else:
            self.nested_urls(value, param, 0)
            raise MediaInvalid("The media part's shape is not recognised.", param=param)

    def nested_urls(self, value: object, param: str, depth: int) -> None:
        """Check URLs inside an unrecognised media value, so that a forbidden URL is
        reported as such even where the shape is refused anyway."""
        if depth > 4:
            return
        if isinstance(value, str):
            try:
                self.policy.check(value)
            except MediaUrlNotAllowed as exc:
                exc.param = param
                raise
            except (MediaInvalid, MediaTooLarge):
                pass
        elif isinstance(value, dict):
            for key, item in value.items():
                if key in _URLISH_KEYS:
                    self.nested_urls(item, f"{param}.{key}", depth + 1)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                self.nested_urls(item, f"{param}[{i}]", depth + 1)

    def source(
        self, source: dict[str, Any], part: dict[str, Any], kind: MediaKind | None, param: str
    ) -> None:
        """An Anthropic-style `source` (/v1/messages), also inside tool results."""
        stype = source.get("type")
        if stype == "url":
            url = source.get("url")
            if not isinstance(url, str):
                raise MediaInvalid("The media source has no URL.", param=param)

            def set_url(r: Resolved) -> None:
                if r.data is None:  # passthrough: the canonical URL
                    source["url"] = r.url
                else:
                    part["source"] = {"type": "base64", "media_type": r.mime, "data": r.base64}

            self.url(url, kind, f"{param}.url", set_url)
        elif stype == "base64":
            if kind is None:
                raise MediaInvalid("This media part type is not supported.", param=param)
            data = _b64(source.get("data"), f"{param}.data")
            declared = source.get("media_type")

            def set_data(r: Resolved) -> None:
                source["data"] = r.base64
                source["media_type"] = r.mime

            self.slots.append(
                _Slot(param, kind, raw=(data, declared if isinstance(declared, str) else None),
                      apply=set_data)
            )  # fmt: skip
        elif stype != "text":
            raise MediaInvalid("The media source type is not supported.", param=param)

    def url(
        self, raw: str, kind: MediaKind | None, param: str, apply: Callable[[Resolved], None]
    ) -> None:
        try:
            ref = self.policy.check(raw)
        except (MediaInvalid, MediaTooLarge, InvalidRequest) as exc:
            exc.param = param
            raise
        if kind is None:
            # Checked first, so a forbidden URL reports as such; then default deny.
            raise MediaInvalid("This media part type is not supported.", param=param)
        self.slots.append(_Slot(param, kind, ref=ref, apply=apply))

    def uuid(self, part: dict[str, Any], param: str, *, has_media: bool) -> None:
        """A client's uuid is vLLM's cache identity: never forward it as sent."""
        value = part["uuid"]
        if value is None:
            return
        if self.settings.uuids is UuidPolicy.drop:
            del part["uuid"]
            if not has_media:
                raise FieldNotAllowed("A media uuid without media is not allowed.", param=param)
            return
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise MediaInvalid("The media uuid must be a string.", param=f"{param}.uuid")
        # Length-prefixed so no (key, uuid) pair can collide with another's concatenation.
        material = f"{len(self.key_name)}:{self.key_name}:{value}".encode()
        namespaced = "gw-" + hashlib.sha256(material).hexdigest()
        part["uuid"] = namespaced
        if not has_media:
            self.slots.append(_Slot(param, MediaKind.image, fixed=namespaced))

    @staticmethod
    def _setter(container: Any, key: Any) -> Callable[[Resolved], None]:
        def apply(r: Resolved) -> None:
            container[key] = r.url

        return apply


def _kind_from_type(ptype: object) -> MediaKind | None:
    if not isinstance(ptype, str):
        return None
    for kind in MediaKind:
        if kind.value in ptype:
            return kind
    return None


class PayloadInspector:
    """Built once per app from settings; owns the media fetcher (an `httpx.AsyncClient`
    over `SafeTransport`). `transport` replaces the inner transport the safe one wraps
    (tests), `resolver` the DNS resolver (tests simulate rebinding with it)."""

    def __init__(
        self,
        settings: MediaSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        check_formats(settings.image_formats)
        self._settings = settings
        self._policy = UrlPolicy(settings)
        self._fetcher = MediaFetcher(settings, transport=transport, resolver=resolver)
        self._inliner = MediaInliner(settings, self._fetcher)

    @property
    def mode(self) -> MediaMode:
        return self._settings.mode

    async def inspect(self, path: str, body: dict[str, Any], *, key_name: str) -> list[str]:
        walker = _Walker(self._settings, self._policy, key_name)
        walker.body(body)  # every check that needs no I/O, before any fetch
        if not walker.slots:
            # Most requests carry no media: no tasks, no gather (~1% of the hot path).
            return []
        tasks = [asyncio.create_task(self._resolve(slot)) for slot in walker.slots]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _resolve(self, slot: _Slot) -> str:
        if slot.fixed is not None:
            return slot.fixed
        try:
            if slot.ref is not None:
                resolved = await self._inliner.resolve(slot.ref, slot.kind)
            else:
                assert slot.raw is not None
                resolved = await self._inliner.validate(slot.kind, *slot.raw)
        except (MediaInvalid, MediaTooLarge) as exc:
            exc.param = exc.param or slot.param
            raise
        if slot.apply is not None:
            slot.apply(resolved)
        return resolved.digest

    async def aclose(self) -> None:
        await self._fetcher.aclose()
