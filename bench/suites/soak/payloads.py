"""Request bodies of the soak: the legitimate mix and the abuse.

Abuse images are built by hand (zlib over rows of zeros), so a 40-megapixel RGBA PNG
costs ~155 KB on the wire and ~1 s to build once; each copy gets a unique text chunk so
that the gateway's verdict cache (by content hash) cannot answer it without a decode.
"""

from __future__ import annotations

import base64
import itertools
import math
import struct
import zlib
from typing import Any

import orjson

from bench.harness.samples import png, png_chunk, png_header_only
from bench.suites.overhead import image_chat, sentences, small_chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Bytes cut from the end of a decode-heavy PNG's pixel data: the last rows are missing,
# so the gateway decodes nearly every pixel (allocating the whole image) and then
# refuses the file as truncated. Its memory and CPU cost is that of a valid image, and
# no engine decodes it (the simulator would, on the load generator's CPU).
HEAVY_CUT_BYTES = 64


class HeavyPng:
    """PNGs of `max_pixels` or just under (RGBA, 4 bytes a pixel once decoded) that
    compress to ~1/1000 of that; `copy(n)` is the same pixels with a unique text chunk."""

    def __init__(self, max_pixels: int, cut: int = HEAVY_CUT_BYTES) -> None:
        self.width = math.isqrt(max_pixels)
        self.height = max_pixels // self.width
        z = zlib.compressobj(9)
        row = b"\x00" * (1 + self.width * 4)  # filter byte + the row's pixels
        idat = b"".join(z.compress(row) for _ in range(self.height)) + z.flush()
        # 8 bits a channel, colour type 6 (RGBA).
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 6, 0, 0, 0)
        self._ihdr = png_chunk(b"IHDR", header)
        self._tail = png_chunk(b"IDAT", idat[:-cut] if cut else idat) + png_chunk(b"IEND", b"")

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def copy(self, nonce: int) -> bytes:
        text = png_chunk(b"tEXt", b"soak\0" + str(nonce).encode())
        return b"\x89PNG\r\n\x1a\n" + self._ihdr + text + self._tail


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def images_chat(model: str, urls: list[str]) -> bytes:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": "Describe the pictures."})
    return orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    )


# --- legitimate traffic -------------------------------------------------------------------

LEGIT_MIX = (("chat", 4), ("stream", 2), ("completion", 2), ("image", 2))


def legit_kinds() -> itertools.cycle[str]:
    """The legitimate mix in a fixed interleaved order (4 chat, 2 streaming chat,
    2 completions, 2 chat with an image in every 10 requests)."""
    order = ["chat", "stream", "completion", "chat", "image"] * 2
    assert sorted(order) == sorted(k for k, n in LEGIT_MIX for _ in range(n))
    return itertools.cycle(order)


def legit_body(kind: str, index: int, model: str) -> tuple[str, bytes]:
    """(path, body) of legitimate request number `index` of `kind`."""
    if kind == "chat":
        return CHAT, small_chat(model)
    if kind == "stream":
        return CHAT, small_chat(model, stream=True)
    if kind == "completion":
        prompt = sentences(1, 40, seed=index)[0]
        return COMPLETIONS, orjson.dumps({"model": model, "prompt": prompt, "max_tokens": 8})
    if kind == "image":
        # A new small image each time (64x64, a colour from the index): a real decode.
        colour = (index % 256, index // 256 % 256, 128)
        return CHAT, image_chat(model, data_url("image/png", png(64, 64, colour)))
    raise ValueError(kind)


# --- abuse --------------------------------------------------------------------------------


def bad_json_bodies(model: str) -> list[tuple[bytes, bytes]]:
    """(content type, body) pairs a parser must refuse with a 4xx."""
    valid = small_chat(model)
    return [
        (b"application/json", valid[: len(valid) // 2]),  # truncated
        (b"application/json", b"this is not json"),
        (b"application/json", b'{"model": "' + b"\xff\xfe" * 8 + b'", "messages": []}'),
        (b"application/json", b"[" * 100_000 + b"]" * 100_000),  # deep nesting
        (b"application/json", b'["not", "an", "object"]'),
        (b"application/json", b'{"model": 1e999999, "messages": NaN}'),
        (b"application/json", b'{"model": "' + model.encode() + b'", "messages": "no"}'),
        (b"text/plain", valid),
    ]


def pixel_bomb_chat(model: str) -> bytes:
    """A chat whose image header claims 100,000 x 100,000 pixels (70 bytes)."""
    return images_chat(model, [data_url("image/png", png_header_only(100_000, 100_000))])


def oversized_media_chat(model: str, max_bytes: int) -> bytes:
    """A chat whose one `data:` image decodes to `max_bytes` + 1 bytes (a PNG signature,
    then zeros): over media.max_bytes, while the body stays under limits.max_body_bytes."""
    blob = b"\x89PNG\r\n\x1a\n" + b"\x00" * (max_bytes + 1 - 8)
    return images_chat(model, [data_url("image/png", blob)])
