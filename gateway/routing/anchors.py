"""Routing keys: a request body -> its canonical prefix stream -> candidate anchors.

The stream is what decides a prefix-cache hit in vLLM, minus the tokenizer: the model
(which also names the LoRA adapter), the `cache_salt`, then each message's role, text
and the content hash of each media item, in order. It is cut at natural boundaries and
hashed as a chain, H(previous digest, segment), so a digest names the whole prefix up to
its boundary, the way vLLM's block hashes name a prefix of tokens (docs/vllm.md,
"Prefix caching"). The digests at those boundaries are the candidate anchors; the policy
picks one of them (policy.py). Hashes are blake2b: stable across processes and replicas,
unlike Python's `hash()`, which is salted per process.

Candidate boundaries (docs/facts.md, "Routing key"):

- the end of the leading system (or developer) messages;
- the end of the last media item of the first user message, so every question about the
  same image shares the image's anchor;
- the end of the first user message, so every turn of a conversation shares it;
- every later message end;
- for plain prompts (`prompt`, `input`): every `block_bytes` bytes, and the end.

Each text is encoded and hashed once; the cost is linear in the body's text and the
number of boundaries. Nothing here raises on any JSON value, whatever its shape: a part
of an unexpected type simply adds nothing to the stream, and nothing recurses on client
nesting. The payload checks reject malformed bodies before routing, but routing must not
depend on them: it is never the place a request crashes
(tests/unit/routing/test_anchors.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.media.types import MEDIA_KEYS, MEDIA_TYPES, SOURCE_KEY

DIGEST_SIZE = 16

# Bodies come from orjson: plain dicts, lists and strs. The checks below test for those
# concrete types, not the collections.abc ones: an ABC isinstance costs about ten times
# more, a quarter of the routing time on a 2k-token chat body (profiled).

# A content part is a media item by the payload rules' tables, the ones the body walk
# applies: by its `type`, or by a media key whatever its `type` says (vLLM picks the part
# type by key presence when `type` is missing; docs/vllm.md).
_MEDIA_KEYS = (*MEDIA_KEYS, SOURCE_KEY)
_SYSTEM_ROLES = frozenset({"system", "developer"})

# Separators between fields of the stream. Text may contain them; a crafted collision
# only co-locates two requests, and the load bound caps what that can cost.
_MESSAGE = b"\x1em"
_TEXT = b"\x1ft"
_MEDIA = b"\x1fi"
_PROMPT = b"\x1ep"


class AnchorKind(StrEnum):
    system = "system"
    media = "media"
    first_user = "first_user"
    message = "message"
    block = "block"
    end = "end"
    session = "session"


@dataclass(frozen=True, slots=True)
class Anchor:
    """A candidate anchor: the chained digest of the stream up to one boundary."""

    digest: bytes
    kind: AnchorKind


class _Chain:
    """Chained hashing of the stream: each cut yields H(previous digest, segment)."""

    __slots__ = ("_digest", "_hasher", "anchors")

    def __init__(self, header: bytes) -> None:
        self._digest = hashlib.blake2b(header, digest_size=DIGEST_SIZE).digest()
        self._hasher = hashlib.blake2b(self._digest, digest_size=DIGEST_SIZE)
        self.anchors: list[Anchor] = []

    def feed(self, data: bytes | memoryview) -> None:
        self._hasher.update(data)

    def cut(self, kind: AnchorKind) -> None:
        self._digest = self._hasher.digest()
        self._hasher = hashlib.blake2b(self._digest, digest_size=DIGEST_SIZE)
        self.anchors.append(Anchor(self._digest, kind))


def _encode(text: str) -> bytes:
    # Lone surrogates survive some JSON parsers; never fail on them.
    return text.encode("utf-8", "surrogatepass")


def _header(body: Mapping[str, Any]) -> bytes:
    model = body.get("model")
    salt = body.get("cache_salt")
    parts = [b"model", _encode(model) if isinstance(model, str) else b""]
    # vLLM mixes cache_salt into the first block hash: a different salt never hits.
    parts += [b"salt", _encode(salt) if isinstance(salt, str) else b""]
    return b"\x00".join(parts)


def _is_media(part: Mapping[str, Any]) -> bool:
    kind = part.get("type")
    # `type` is client JSON: a list or an object is unhashable, so test for str first.
    if isinstance(kind, str) and kind in MEDIA_TYPES:
        return True
    return any(key in part for key in _MEDIA_KEYS)


def _fallback_media_id(part: Mapping[str, Any]) -> bytes:
    """Identity of a media item without a validated hash: its URL (passthrough mode)."""
    for key in _MEDIA_KEYS:
        value = part.get(key)
        if isinstance(value, dict):
            value = value.get("url", value.get("data"))
        if isinstance(value, str):
            return hashlib.blake2b(_encode(value), digest_size=DIGEST_SIZE).digest()
    return b"?"


def _parts(content: Any) -> Sequence[Any]:
    if isinstance(content, str):
        return (content,)
    if isinstance(content, list):
        return content
    return ()


def _by_part(media: Mapping[str, str]) -> dict[str, str]:
    """The payload walk's media digests by path (`messages[0].content[1].image_url.url`),
    keyed by the content part that holds each (`messages[0].content[1]`)."""
    out: dict[str, str] = {}
    for path, digest in media.items():
        start = path.find(".content[")
        end = path.find("]", start)
        if start >= 0 and end >= 0:
            out.setdefault(path[: end + 1], digest)
    return out


def _chat_anchors(
    chain: _Chain,
    messages: Sequence[Any],
    media: Mapping[str, str],
    preamble: str | None,
    field: str,
) -> None:
    # Each media part is placed by the digest the payload walk found at its path; a part
    # it has none for (passthrough mode, or an unusual shape) by the part's URL.
    by_part = _by_part(media) if media else {}
    had_system = preamble is not None
    leading_system = True
    seen_user = False
    if preamble is not None:
        # /v1/responses `instructions`: rendered as a leading system message.
        chain.feed(_MESSAGE + b"system" + _TEXT + _encode(preamble))
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        role_s = role if isinstance(role, str) else ""
        if leading_system:
            if role_s in _SYSTEM_ROLES:
                had_system = True
            else:
                leading_system = False
                if had_system:
                    chain.cut(AnchorKind.system)
        chain.feed(_MESSAGE + _encode(role_s))
        parts = _parts(message.get("content"))
        first_user = role_s == "user" and not seen_user
        last_media = -1
        if first_user:
            seen_user = True
            for i, part in enumerate(parts):
                if isinstance(part, dict) and _is_media(part):
                    last_media = i
        for i, part in enumerate(parts):
            if isinstance(part, str):
                chain.feed(_TEXT + _encode(part))
            elif isinstance(part, dict):
                if _is_media(part):
                    digest = by_part.get(f"{field}[{index}].content[{i}]")
                    if digest is not None:
                        chain.feed(_MEDIA + _encode(digest))
                    else:
                        chain.feed(_MEDIA + _fallback_media_id(part))
                    if i == last_media:
                        chain.cut(AnchorKind.media)
                else:
                    text = part.get("text")
                    if isinstance(text, str):
                        chain.feed(_TEXT + _encode(text))
        if not leading_system:
            chain.cut(AnchorKind.first_user if first_user else AnchorKind.message)
    if leading_system and had_system:
        # Only system messages: the whole request is one anchor.
        chain.cut(AnchorKind.end)


def _prompt_bytes(prompt: Any) -> tuple[bytes, int] | None:
    """The bytes of a plain prompt and how many bytes one character counts for.

    Token-id prompts are packed as 8-byte integers; a token is about four characters of
    text, so their blocks are twice as many bytes (close to the text blocks' tokens).
    A batch (a list of prompts) is keyed on its first prompt: the batch is one request to
    one engine. vLLM's prompts nest at most that deep (a list of token-id lists), so
    one step down is all that is taken: deeper nesting has no key, and no recursion.
    """
    for depth in range(2):
        if isinstance(prompt, str):
            return _encode(prompt), 1
        if not isinstance(prompt, list) or not prompt:
            return None
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            try:
                return array("q", prompt).tobytes(), 2
            except OverflowError:
                return None
        if depth == 0:
            prompt = prompt[0]
    return None


def _prompt_anchors(chain: _Chain, data: bytes, block_bytes: int) -> None:
    chain.feed(_PROMPT)
    view = memoryview(data)
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        chain.feed(view[start : start + block_bytes])
        chain.cut(AnchorKind.block)
    tail = len(data) % block_bytes
    if tail or not data:
        chain.feed(view[len(data) - tail :])
        chain.cut(AnchorKind.end)


def candidate_anchors(
    body: dict[str, Any] | None,
    media: Mapping[str, str] | None = None,
    *,
    block_bytes: int,
    max_candidates: int,
) -> list[Anchor]:
    """The candidate anchors of a request, shortest first; empty if it has no prompt.
    `media` maps the paths of the body's media items to their content digests (the
    payload walk's findings)."""
    if not isinstance(body, dict):
        return []
    chain = _Chain(_header(body))
    messages = body.get("messages")
    instructions = body.get("instructions")
    preamble = instructions if isinstance(instructions, str) else None
    if isinstance(messages, list) and messages:
        _chat_anchors(chain, messages, media or {}, None, "messages")
    else:
        field = "prompt" if "prompt" in body else "input"
        source = body.get(field)
        if isinstance(source, list) and source and isinstance(source[0], dict):
            # /v1/responses input items and embeddings-as-messages carry chat messages.
            _chat_anchors(chain, source, media or {}, preamble, field)
        else:
            prompt = _prompt_bytes(source)
            if prompt is None:
                return []
            data, scale = prompt
            _prompt_anchors(chain, data, block_bytes * scale)
    # Beyond the cap the request keeps its first candidates: sharing happens at the
    # start of a prompt, and cutting the middle out would make every long conversation
    # look like it branches at the cut (hotspots.py).
    return chain.anchors[:max_candidates]


def session_anchor(body: dict[str, Any] | None, session: str, key: bytes = b"") -> Anchor:
    """The anchor of a client-named session: it replaces the prefix candidates. A
    session is its client key's (`key`, the key's digest): another key naming the same
    session gets another anchor."""
    model = body.get("model") if isinstance(body, dict) else None
    header = b"session\x00" + key + b"\x00" + (_encode(model) if isinstance(model, str) else b"")
    digest = hashlib.blake2b(header + b"\x00" + _encode(session), digest_size=DIGEST_SIZE).digest()
    return Anchor(digest, AnchorKind.session)
