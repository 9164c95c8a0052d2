"""A deterministic pseudo-tokenizer: every 4 bytes of UTF-8 are one token.

Reversible, so /detokenize works, and fast (one struct.unpack per text). Token ids of full
chunks are the 4 bytes as a big-endian integer; a trailing partial chunk carries its
length above bit 32. Placeholder tokens for media items sit above bit 34 and decode to
their marker text.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

_PARTIAL_SHIFT = 32
_PLACEHOLDER_BASE = 1 << 34
MAX_TOKEN_ID = _PLACEHOLDER_BASE + 3

PLACEHOLDERS = {"image": 0, "video": 1, "audio": 2}
_MARKERS = ("<|image_pad|>", "<|video_pad|>", "<|audio_pad|>")


def encode(text: str) -> list[int]:
    data = text.encode("utf-8")
    full = len(data) >> 2
    ids = list(struct.unpack_from(f">{full}I", data)) if full else []
    rest = data[full << 2 :]
    if rest:
        ids.append((len(rest) << _PARTIAL_SHIFT) | int.from_bytes(rest, "big"))
    return ids


def placeholder(kind: str) -> int:
    return _PLACEHOLDER_BASE + PLACEHOLDERS[kind]


def valid_id(token: object) -> bool:
    if type(token) is not int or token < 0:
        return False
    if token >= _PLACEHOLDER_BASE:
        return token <= MAX_TOKEN_ID
    length = token >> _PARTIAL_SHIFT
    return length == 0 or (length <= 3 and (token & 0xFFFFFFFF) < 1 << (8 * length))


def decode(ids: Iterable[int]) -> str:
    """Text of token ids; the caller checks them with `valid_id` first."""
    out = bytearray()
    for token in ids:
        if token >= _PLACEHOLDER_BASE:
            out += _MARKERS[token - _PLACEHOLDER_BASE].encode()
            continue
        length = token >> _PARTIAL_SHIFT or 4
        out += (token & 0xFFFFFFFF).to_bytes(length, "big")
    return out.decode("utf-8", errors="replace")
