"""One walk over a whole parsed JSON body: every object at every depth is looked at as
a possible media part, and every list and object value is descended into.

No key's presence switches inspection off, and the route decides nothing about where
media may sit: vLLM drops unknown keys from content parts and infers a part's type from
its keys (docs/media.md), so a checker that skips objects by shape loses the day vLLM
accepts a new one. The walk does no I/O: it raises on anything refused and returns the
media items to resolve, each with the path it was found at and a setter that writes
the resolved form back into the body.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gateway.errors import FieldNotAllowed, InvalidRequest, MediaInvalid, MediaTooLarge
from gateway.media.av import audio_type
from gateway.media.resolve import Resolved
from gateway.media.settings import MediaSettings
from gateway.media.types import MEDIA_KEYS, MEDIA_TYPES, SOURCE_KEY, MediaKind, UuidPolicy
from gateway.media.urls import DataUrl, RemoteUrl, UrlPolicy
from gateway.payload.fields import FieldRules
from gateway.payload.identity import Identity
from gateway.payload.rules import FORBIDDEN_ANYWHERE, FORBIDDEN_TYPES, MAX_DEPTH, URLISH_KEYS

# Writes an item's resolved form into the body; says whether that changed the body.
Setter = Callable[[Resolved], bool]
# Where the walk is: () at the top, else (parent, key or index), or a rendered path.
Trail = tuple[Any, ...] | str
_URL = frozenset({"url"})
_URL_DATA = frozenset({"url", "data"})
_PART_KEYS = frozenset({*MEDIA_KEYS, SOURCE_KEY, "uuid"})
# The keys of a media part whose values are checked where they are found.
_HANDLED = frozenset({*MEDIA_KEYS, SOURCE_KEY})
# Part types whose media vLLM (0.32, renderers/chat_utils.py) reads alike whether or not
# the part carries a `uuid`, with the key it reads the media from; with a uuid it reads
# the first of `_UUID_BRANCH_KEYS` the part holds, so the part must hold no other.
_UUID_PARTS = {
    "image_url": "image_url",
    "input_image": "image_url",
    "audio_url": "audio_url",
    "input_audio": "input_audio",
    "video_url": "video_url",
}
_UUID_BRANCH_KEYS = frozenset(
    {"image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds",
     "prompt_embeds", "audio_url", "input_audio", "video_url", "tool_reference"}
)  # fmt: skip
# The media keys that branch reads a URL or inline audio from (`_UUID_PARTS`' values).
# A part without a type is read by that same branch with or without a uuid, so an
# untyped part holding one of these (and no other branch key) takes a uuid too.
_UUID_KEYS = frozenset(_UUID_PARTS.values())
# Keys that need more than a descent; every other key costs one set lookup.
_SPECIAL_KEYS = frozenset({*MEDIA_KEYS, SOURCE_KEY, *FORBIDDEN_ANYWHERE, *URLISH_KEYS})


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media reference found in a body. Exactly one of `ref`, `raw`, `fixed` is set:
    a URL to resolve, inline bytes to validate (with their declared type), or the
    identity of a uuid-only reference to an item the engine has cached."""

    path: str
    kind: MediaKind
    ref: RemoteUrl | DataUrl | None = None
    raw: tuple[bytes, str | None] | None = None
    fixed: str | None = None
    apply: Setter | None = None
    # The content part that may take a `uuid` named for this item (the inspector names
    # one from the item's digest when tenants are isolated): set when the item is its
    # part's only media and vLLM reads the part alike with a uuid (`_UUID_PARTS`, or a
    # part without a type in a list).
    part: dict[str, Any] | None = None
    # The item's part carries the client's own uuid (namespaced per key), which vLLM
    # keys its multimodal caches on instead of the bytes.
    named: bool = False

    def isolable(self, passthrough: bool) -> bool:
        """Whether the engine can be given a per-tenant name for this item: its part
        names it (the client's uuid, or a uuid-only reference), or the gateway can,
        from bytes it holds (not a URL the engine fetches itself in passthrough)."""
        if self.fixed is not None or self.named:
            return True
        return self.part is not None and not (passthrough and isinstance(self.ref, RemoteUrl))


def render(trail: Trail) -> str:
    """`messages[0].content[1].image_url` for a trail."""
    keys: list[str | int] = []
    while isinstance(trail, tuple) and trail:
        trail, key = trail
        keys.append(key)
    out = trail if isinstance(trail, str) else ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def _b64(value: object, path: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise MediaInvalid("The inline media data is missing.", param=path)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MediaInvalid("The inline media data is not valid base64.", param=path) from None


def _kind_of_type(ptype: object) -> MediaKind | None:
    if isinstance(ptype, str):
        for kind in MediaKind:
            if kind.value in ptype:
                return kind
    return None


def _set(container: Any, key: Any) -> Setter:
    def apply(r: Resolved) -> bool:
        # A data: URL sent in canonical form comes back as the very string sent
        # (gateway/media/resolve.py): the body is then forwarded as the client sent it.
        if container[key] == r.url:
            return False
        container[key] = r.url
        return True

    return apply


class Walk:
    """The checks of one body: its top-level fields (`FieldRules`), then every object
    in it. `run` raises on anything refused; afterwards `items` holds the media to
    resolve and `changed` says whether the body was rewritten."""

    def __init__(
        self,
        media: MediaSettings,
        fields: FieldRules,
        policy: UrlPolicy,
        identity: Identity,
    ) -> None:
        self.media = media
        self.fields = fields
        self.policy = policy
        self.identity = identity
        self.items: list[MediaItem] = []
        self.changed = False

    def run(self, body: dict[str, Any], *, creates_response: bool = False) -> None:
        """`creates_response`: the body asks for a stored response (`POST
        /v1/responses`), which gets a request id bound to the key (fields.py)."""
        self.changed = self.fields.check_top_level(
            body, self.identity, creates_response=creates_response
        )
        self.visit(body, (), 0)

    # --- the walk ----------------------------------------------------------------------

    def node(self, value: object, trail: Trail, depth: int) -> None:
        if isinstance(value, dict):
            self.visit(value, trail, depth)
        elif isinstance(value, list):
            if depth >= MAX_DEPTH:
                raise InvalidRequest("The request body is nested too deeply.", param=render(trail))
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    self.visit(item, (trail, i), depth + 1)
                elif isinstance(item, list):
                    self.node(item, (trail, i), depth + 1)

    def visit(
        self, obj: dict[str, Any], trail: Trail, depth: int, skip: frozenset[str] = frozenset()
    ) -> None:
        """Checks `obj` and everything below it; `skip` names keys its caller handled."""
        if depth >= MAX_DEPTH:
            raise InvalidRequest("The request body is nested too deeply.", param=render(trail))
        ptype = obj.get("type")
        if not isinstance(ptype, str | None) and not _PART_KEYS.isdisjoint(obj):
            # Checked before the part's values, so it is what a client hears about.
            raise InvalidRequest(
                "A content part's type must be a string.", param=render((trail, "type"))
            )
        is_part = isinstance(ptype, str) and ptype in MEDIA_TYPES
        before = len(self.items)
        for key, value in obj.items():
            if key not in _SPECIAL_KEYS:
                # The common case: paths are rendered only where something is found.
                if isinstance(value, dict):
                    self.visit(value, (trail, key), depth + 1)
                elif isinstance(value, list):
                    self.node(value, (trail, key), depth + 1)
                continue
            if key in skip:
                continue
            path = render((trail, key))
            if key in FORBIDDEN_ANYWHERE:
                self.fields.check_anywhere(key, value, path)
                # An embeds key makes a part, uuid and all (vLLM infers its type so).
                is_part = is_part or key in FORBIDDEN_TYPES
            if key in MEDIA_KEYS:
                is_part = True
                self.media_value(obj, key, value, ptype, path, depth)
            elif key == SOURCE_KEY and isinstance(value, dict):
                self.source(obj, value, ptype, path, depth)
            elif isinstance(value, dict):
                self.visit(value, path, depth + 1)
            elif isinstance(value, list):
                self.node(value, path, depth + 1)
        if is_part:
            self.part(obj, ptype, render(trail), skip, has_media=len(self.items) > before)
            if len(self.items) == before + 1:
                listed = isinstance(trail, tuple) and bool(trail) and isinstance(trail[1], int)
                self.uuid_part(obj, ptype, listed=listed)

    def uuid_part(self, part: dict[str, Any], ptype: object, *, listed: bool) -> None:
        """Marks the last item, its part's only one, as named by `part`'s uuid when vLLM
        (0.32, renderers/chat_utils.py) reads the item with it. A part with a uuid is
        read by its keys, whatever its type: the first of `_UUID_BRANCH_KEYS`, so the
        part must hold only the item's. Without one it may take the gateway's when
        reading it with one changes nothing: typed as in `_UUID_PARTS`, or without a
        type (`listed`: a content part sits in a list; elsewhere no uuid is added)."""
        branch = _UUID_BRANCH_KEYS.intersection(part)
        if len(branch) != 1:
            return
        (key,) = branch
        item = self.items[-1]
        if key not in _UUID_KEYS or item.fixed is not None:
            return
        if not item.path.endswith((f".{key}", f".{key}.url")):
            return
        if part.get("uuid") is not None:
            self.items[-1] = dataclasses.replace(item, named=True)
        elif _UUID_PARTS.get(ptype) == key if isinstance(ptype, str) else listed:
            self.items[-1] = dataclasses.replace(item, part=part)

    def part(
        self,
        part: dict[str, Any],
        ptype: object,
        path: str,
        skip: frozenset[str],
        *,
        has_media: bool,
    ) -> None:
        """Checks on an object that vLLM may read as a media part."""
        if isinstance(ptype, str) and ptype in FORBIDDEN_TYPES:
            self.fields.check_part_type(ptype, path)
        if isinstance(ptype, str) and ptype in MEDIA_TYPES:
            if not isinstance(part.get(SOURCE_KEY), dict | None):
                raise MediaInvalid("The media source must be an object.", param=path)
            # Its media values check what lies below them; anything else holds no URL.
            self.stray_urls(part, path, skip | _HANDLED)
        else:
            for key in URLISH_KEYS.intersection(part).difference(skip):
                if isinstance(part[key], str):
                    self.stray_urls({key: part[key]}, path, frozenset())
        if "uuid" in part:
            self.uuid(part, path, has_media=has_media)

    # --- media values --------------------------------------------------------------------

    def media_value(
        self,
        obj: dict[str, Any],
        key: str,
        value: object,
        ptype: object,
        path: str,
        depth: int,
    ) -> None:
        if value is None:
            return  # vLLM skips empty media; a uuid alone is handled by `part`
        kind = MEDIA_KEYS[key]
        # Typed as media, the object must carry media in a shape vLLM reads; untyped, a
        # value that names nothing fetchable is left alone (JSON schemas use these keys).
        typed = isinstance(ptype, str) and ptype in MEDIA_TYPES
        if key == "input_audio":
            if not typed and isinstance(value, dict) and "data" not in value:
                # No audio in it (a tool schema's property, say): walked like any object.
                self.visit(value, path, depth + 1)
            else:
                self.input_audio(value, path)
        elif isinstance(value, str):
            self.url(value, kind, path, _set(obj, key))
        elif isinstance(value, dict):
            if not self.url_object(value, kind, path, depth + 1) and typed:
                raise MediaInvalid("The media part's shape is not recognised.", param=path)
        elif isinstance(value, list):
            if depth + 1 >= MAX_DEPTH:
                raise InvalidRequest("The request body is nested too deeply.", param=path)
            for i, item in enumerate(value):
                item_path = f"{path}[{i}]"
                if isinstance(item, str):
                    self.url(item, kind, item_path, _set(value, i))
                elif isinstance(item, dict):
                    if not self.url_object(item, kind, item_path, depth + 2):
                        raise MediaInvalid(
                            "The media item's shape is not recognised.", param=item_path
                        )
                elif item is not None:
                    raise MediaInvalid("The media item's shape is not recognised.", param=item_path)
        elif typed or not isinstance(value, bool | int | float):
            raise MediaInvalid("The media part's shape is not recognised.", param=path)

    def url_object(
        self, value: dict[str, Any], kind: MediaKind | None, path: str, depth: int
    ) -> bool:
        """`{"url": ...}` under a media key; whether it held a URL. Its other keys are
        walked like any object's and may carry no media, nor a URL under another name."""
        url = value.get("url")
        if isinstance(url, str):
            self.url(url, kind, f"{path}.url", _set(value, "url"))
        elif url is not None:
            raise MediaInvalid("The media URL must be a string.", param=f"{path}.url")
        self.stray_urls(value, path, _URL)
        before = len(self.items)
        self.visit(value, path, depth, _URL)
        if len(self.items) > before:
            raise MediaInvalid("The media item's shape is not recognised.", param=path)
        return url is not None

    def input_audio(self, value: object, path: str) -> None:
        if not isinstance(value, dict):
            raise MediaInvalid("input_audio must be an object.", param=path)
        declared = audio_type(value.get("format"))
        if declared is None:
            raise MediaInvalid("The input_audio format is not allowed.", param=path)
        data = _b64(value.get("data"), f"{path}.data")

        def set_audio(r: Resolved) -> bool:
            value["data"] = r.base64
            return True

        self.add(MediaItem(path, MediaKind.audio, raw=(data, declared), apply=set_audio))

    def source(
        self, part: dict[str, Any], source: dict[str, Any], ptype: object, path: str, depth: int
    ) -> None:
        """An Anthropic-style `source`, decided as vLLM (0.32) decides it: by its `type`.
        A `url` source is fetched; any other type (a missing one included) becomes a data
        URL built from `data` and `media_type`. Only `url` sources with a URL and
        `base64` sources without one pass; the media either names is checked."""
        kind = _kind_of_type(ptype)
        url = source.get("url")
        stype = source.get("type")
        if stype == "url" or url is not None:
            if not isinstance(url, str):
                raise MediaInvalid("The media URL must be a string.", param=f"{path}.url")
            if stype != "url":
                # vLLM would decode `data` and ignore this URL: never one without the other.
                self.policy_check(url, f"{path}.url")
                raise MediaInvalid("A media source with a URL must be of type 'url'.", param=path)

            def set_url(r: Resolved) -> bool:
                if r.data is None:  # passthrough: the canonical URL, and nothing else
                    part[SOURCE_KEY] = {"type": "url", "url": r.url}
                else:
                    part[SOURCE_KEY] = {"type": "base64", "media_type": r.mime, "data": r.base64}
                return True

            self.url(url, kind, f"{path}.url", set_url)
        elif stype == "base64":
            if kind is None:
                raise MediaInvalid("This media part type is not supported.", param=path)
            data = _b64(source.get("data"), f"{path}.data")
            declared = source.get("media_type")

            def set_data(r: Resolved) -> bool:
                source["data"] = r.base64
                source["media_type"] = r.mime
                return True

            raw = (data, declared if isinstance(declared, str) else None)
            self.add(MediaItem(path, kind, raw=raw, apply=set_data))
        elif kind is not None:
            # An image, video or audio block with a source vLLM may read some other way.
            raise MediaInvalid("The media source type is not supported.", param=path)
        self.stray_urls(source, path, _URL_DATA)
        self.visit(source, path, depth + 1, _URL_DATA)

    def stray_urls(self, obj: dict[str, Any], path: str, skip: frozenset[str]) -> None:
        """Below a media part or value, a URL under a name vLLM does not read media from
        (`url`, `uri`, `src`, `href`) is refused, not ignored: default deny for shapes
        vLLM may read tomorrow. Its URL is checked first, so a forbidden one reports as
        such. `skip` names `obj`'s keys that its caller checks itself."""
        stack: list[tuple[dict[str, Any] | list[Any], str, frozenset[str]]] = [(obj, path, skip)]
        while stack:
            node, where, skipped = stack.pop()
            items: Iterable[tuple[str | int, Any]] = (
                node.items() if isinstance(node, dict) else enumerate(node)
            )
            for key, value in items:
                if key in skipped:
                    continue
                below = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
                if key in URLISH_KEYS and isinstance(value, str):
                    self.policy_check(value, below)
                    raise MediaInvalid("The media item's shape is not recognised.", param=path)
                if isinstance(value, dict | list):
                    stack.append((value, below, frozenset()))

    def add(self, item: MediaItem) -> None:
        if len(self.items) >= self.media.max_items:
            raise MediaTooLarge("The request carries more media items than this gateway accepts.")
        self.items.append(item)

    def policy_check(self, raw: str, path: str) -> RemoteUrl | DataUrl:
        try:
            return self.policy.check(raw)
        except (MediaInvalid, MediaTooLarge, InvalidRequest) as exc:
            exc.param = path
            raise

    def url(self, raw: str, kind: MediaKind | None, path: str, apply: Setter) -> None:
        ref = self.policy_check(raw, path)
        if kind is None:
            # Checked first, so a forbidden URL reports as such; then default deny.
            raise MediaInvalid("This media part type is not supported.", param=path)
        self.add(MediaItem(path, kind, ref=ref, apply=apply))

    def uuid(self, part: dict[str, Any], path: str, *, has_media: bool) -> None:
        """A client's uuid is vLLM's cache identity: never forwarded as sent."""
        value = part["uuid"]
        if value is None:
            return
        self.changed = True
        if self.media.uuids is UuidPolicy.drop:
            del part["uuid"]
            if not has_media:
                raise FieldNotAllowed("A media uuid without media is not allowed.", param=path)
            return
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise MediaInvalid("The media uuid must be a string.", param=f"{path}.uuid")
        namespaced = self.identity.namespaced("uuid", str(value))
        part["uuid"] = namespaced
        if not has_media:
            kind = _kind_of_type(part.get("type")) or MediaKind.image
            self.add(MediaItem(path, kind, fixed=namespaced))
