"""Media loading as a DEFAULT vLLM does it: the hole the gateway closes.

Like vLLM's MediaConnector: any http(s) host unless `--allowed-media-domains` is given
(exact hostname match), redirects followed and never re-checked, no private-address
blocking, `file:` only under `--allowed-local-media-path`, `data:` URLs base64-decoded
(the MIME type ignored for images, Pillow sniffs). Do not copy any of this into the
gateway; it is deliberately unsafe.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image

from bench.sim.errors import SimError, bad_request

# vLLM's per-modality fetch timeouts (VLLM_IMAGE_FETCH_TIMEOUT and friends), in seconds.
TIMEOUTS = {"image": 5.0, "video": 30.0, "audio": 10.0}
MAX_DOWNLOAD = 256 * 1024 * 1024  # vLLM's VLLM_MEDIA_MAX_BYTES default

# Qwen3-VL: 16 px patches merged 2x2, so one token per 32x32 pixels, plus the
# vision start/end markers. Gives 198 tokens for 448x448 and 786 for 896x896, against the
# reference run's 220 and 808 prompt tokens with ~20 tokens of text (docs/vllm.md).
PIXELS_PER_TOKEN_SIDE = 32
MAX_IMAGE_TOKENS = 16384


@dataclass(frozen=True)
class MediaRef:
    """A media item named in a request, in prompt order."""

    kind: str  # "image" | "video" | "audio"
    url: str
    # The part's `uuid`: vLLM (0.32, multimodal/processing/inputs.py) takes it as the
    # item's cache identity instead of hashing the bytes.
    uuid: str | None = None


@dataclass(frozen=True)
class MediaItem:
    kind: str
    digest: bytes
    tokens: int
    cached: bool  # processor cache hit: no encoder time in the latency model


def image_tokens(width: int, height: int) -> int:
    side = PIXELS_PER_TOKEN_SIDE
    grid = max(1, round(width / side)) * max(1, round(height / side))
    return min(MAX_IMAGE_TOKENS, grid) + 2


def _decode_image(data: bytes) -> int:
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return image_tokens(*img.size)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # vLLM returns Pillow's text as is ("cannot identify image file <_io.BytesIO
        # object at 0x...>"), heap address included; so does the simulator, so that the
        # gateway's tests see what a real engine leaks.
        raise bad_request(f"Failed to load image: {exc}") from None


def _other_tokens(kind: str, size: int) -> int:
    # No audio or video decoding: token counts grow with the payload size, which is
    # enough for cache identity and load; ~1 token per 1,280 audio bytes (40 ms of
    # 16 kHz 16-bit mono) and per 1 KiB of video.
    per = 1280 if kind == "audio" else 1024
    return max(16, min(MAX_IMAGE_TOKENS, math.ceil(size / per)))


class MediaConnector:
    def __init__(
        self,
        client: httpx.AsyncClient,
        model: str,
        allowed_domains: tuple[str, ...],
        allowed_local_path: str | None,
    ) -> None:
        self.client = client
        self.model = model.encode()
        self.allowed_domains = allowed_domains
        self.allowed_local_path = Path(allowed_local_path).resolve() if allowed_local_path else None

    async def load_bytes(self, ref: MediaRef) -> bytes:
        url = ref.url
        if url.startswith("data:"):
            return _data_url(url)
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme in ("http", "https"):
            if self.allowed_domains and parts.hostname not in self.allowed_domains:
                raise bad_request(
                    f"The URL must be from one of the allowed domains: "
                    f"{list(self.allowed_domains)}. Input URL domain: {parts.hostname}"
                )
            return await self._fetch(url, TIMEOUTS[ref.kind])
        if scheme == "file":
            return self._local(parts.path)
        raise bad_request("The URL must be either a HTTP, data or file URL.")

    async def _fetch(self, url: str, seconds: float) -> bytes:
        try:
            async with self.client.stream("GET", url, timeout=seconds) as response:
                response.raise_for_status()
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_DOWNLOAD:
                        raise SimError(422, "Media download exceeds the size limit.")
                    chunks.append(chunk)
                return b"".join(chunks)
        except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:
            raise SimError(422, f"Failed to fetch media from URL: {exc}") from None

    def _local(self, path: str) -> bytes:
        # vLLM answers 500 here when no local path is allowed (docs/vllm.md); the
        # simulator answers 400 with vLLM's message, since it must never 500.
        if self.allowed_local_path is None:
            raise bad_request("Cannot load local files without `--allowed-local-media-path`.")
        target = Path(unquote(path)).resolve()
        if not target.is_relative_to(self.allowed_local_path):
            raise bad_request(
                f"The file path {target} must be a subpath of "
                f"`--allowed-local-media-path {self.allowed_local_path}`."
            )
        try:
            return target.read_bytes()
        except OSError:
            raise bad_request(f"Cannot read local file {target}.") from None

    def digest(self, data: bytes) -> bytes:
        # vLLM hashes the model id and the original encoded bytes (blake3); blake2b here.
        return hashlib.blake2b(self.model + b"\0" + data, digest_size=16).digest()

    async def measure(self, kind: str, data: bytes) -> int:
        if kind == "image":
            if len(data) < 65536:
                return _decode_image(data)
            return await asyncio.to_thread(_decode_image, data)
        return _other_tokens(kind, len(data))


def _data_url(url: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise bad_request("Only base64 data URLs are supported.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("The data URL does not carry valid base64.") from None
