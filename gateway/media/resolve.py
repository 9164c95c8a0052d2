"""Turning a checked media reference into what the engine receives.

- `data:` URLs (every mode): validated, then rewritten in canonical form.
- Remote URLs, mode `inline`: fetched through `MediaFetcher`, validated, rewritten into
  a `data:` URL, so the engine makes no outbound request at all.
- Remote URLs, mode `passthrough`: forwarded as the canonical URL (not fetched here).
- Remote URLs, mode `data_only`: already refused by `UrlPolicy`.

Each result carries a digest, the media identity for routing: the sha256 of the base64
text of the validated bytes as the engine receives them, so the same image has the same
digest whether it came as a `data:` URL (in any spelling) or was fetched; for a `data:`
URL kept as sent it is the hash its cache key already took, so nothing is hashed twice.
In passthrough, the sha256 of the canonical URL (the gateway never sees the bytes);
video sent as JPEG frames, of the frames' own digests.

Two steps per item, so that a request is judged whole before anything is decoded:
`prepare` fetches and reads headers (or finds the item cached) and says how many pixels
the item holds; the caller sums them over the request (`media.max_request_pixels`), then
calls each item's `finish`, which decodes on the `Decoder`'s pool under its budget.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import pybase64

from gateway.errors import MediaInvalid
from gateway.media.av import (
    AvInfo,
    decode_jpeg_frames,
    read_jpeg_frames,
    validate_audio,
    validate_video,
)
from gateway.media.cache import MediaCache
from gateway.media.decoder import Decoder
from gateway.media.fetch import FetchAllowance, MediaFetcher
from gateway.media.images import ImageHeader, decode_cost, decode_image, read_header
from gateway.media.settings import MediaSettings
from gateway.media.types import MediaKind, MediaMode
from gateway.media.urls import DataUrl, RemoteUrl


@dataclass(frozen=True)
class Resolved:
    url: str  # a canonical data: URL, or the canonical remote URL in passthrough
    mime: str | None
    data: bytes | None  # validated bytes (None in passthrough)
    digest: str  # sha256 hex
    pixels: int = 0  # width x height x frames of an image or video/jpeg frames

    @property
    def base64(self) -> str:
        return pybase64.b64encode(self.data or b"").decode("ascii")

    @property
    def held(self) -> int:
        """Bytes this result keeps in memory: its URL text (a data: URL holds the item
        again, in base64) and its validated bytes. What the media cache charges."""
        return len(self.url) + len(self.data or b"")


@dataclass(frozen=True)
class Prepared:
    """An item checked as far as it can be without decoding it."""

    pixels: int  # what a full decode produces (every frame), for the per-request sum
    finish: Callable[[], Awaitable[Resolved]]


def fingerprint(settings: MediaSettings) -> str:
    """A digest of every media setting, for cache keys."""
    return hashlib.sha256(settings.model_dump_json().encode()).hexdigest()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _inlined(mime: str, data: bytes, pixels: int = 0) -> Resolved:
    """Validated `data` as its canonical data: URL (`data_url`), with its digest."""
    text = pybase64.b64encode(data)
    url = f"data:{mime};base64,{text.decode('ascii')}"
    return Resolved(url, mime, data, hashlib.sha256(text).hexdigest(), pixels)


def _ready(resolved: Resolved) -> Prepared:
    async def finish() -> Resolved:
        return resolved

    return Prepared(resolved.pixels, finish)


def _video_jpeg(video: AvInfo, pixels: int) -> Resolved:
    url = "data:video/jpeg;base64," + ",".join(
        pybase64.b64encode(f).decode("ascii") for f in video.frames
    )
    digest = _digest(b"".join(hashlib.sha256(f).digest() for f in video.frames))
    return Resolved(url, video.mime, video.data, digest, pixels)


class MediaInliner:
    def __init__(self, settings: MediaSettings, fetcher: MediaFetcher, decoder: Decoder) -> None:
        self._settings = settings
        self._fetcher = fetcher
        self._decoder = decoder
        self._cache: MediaCache[Resolved] = MediaCache(settings.cache_bytes, settings.cache_ttl)
        # Every key carries the settings a verdict was reached under (all of them: any
        # change of a limit, a format list or the depth makes every verdict new).
        self._fingerprint = fingerprint(settings)

    async def prepare(
        self,
        ref: RemoteUrl | DataUrl,
        kind: MediaKind,
        owner: str,
        allowance: FetchAllowance | None,
        scope: str = "",
    ) -> Prepared:
        """`ref` checked as far as it can be without decoding it. `owner` (the key) shares
        the fetch slots and the decode line fairly with other owners; a remote item's
        bytes, fetched or cached, are charged to `allowance` (the request's). `scope`
        partitions the cache: results cached under one scope are never found under
        another (a tenant's namespace when tenants are isolated, else "")."""
        if isinstance(ref, DataUrl):
            if ref.frames:
                return await self.prepare_bytes(kind, ref.data, ref.mime, ref.frames, owner=owner)
            # The same inline item sent again (a conversation re-sends its images every
            # turn) is not validated again: the verdict depends only on the payload
            # (which fixes the bytes), the declared type and the settings, and the key
            # holds all three. A hit costs the sha256 of the base64 text, 1.0 ms for
            # 1.3 MB here, against 6.8 ms for Pillow's decode of the image; that hash is
            # also the image's digest for routing when the URL is kept as sent.
            data_key = f"{scope}\0data\0{kind}\0{ref.mime}\0{self._fingerprint}\0{ref.digest}"
            return await self._cached(
                data_key, lambda: self.prepare_bytes(kind, ref.data, ref.mime, owner=owner, ref=ref)
            )
        canonical = ref.canonical
        if self._settings.mode is MediaMode.passthrough:
            return _ready(Resolved(canonical, None, None, _digest(b"url\0" + canonical.encode())))
        if self._settings.mode is not MediaMode.inline:
            raise MediaInvalid("Remote media is not accepted by this gateway.")
        return await self._cached(
            f"{scope}\0{kind}\0{self._fingerprint}\0{canonical}",
            lambda: self._fetch(ref, kind, owner, allowance),
            allowance,
        )

    async def _fetch(
        self, ref: RemoteUrl, kind: MediaKind, owner: str, allowance: FetchAllowance | None
    ) -> Prepared:
        fetched = await self._fetcher.fetch(ref, owner, allowance)
        return await self.prepare_bytes(kind, fetched.data, fetched.content_type, owner=owner)

    async def _cached(
        self,
        key: str,
        produce: Callable[[], Awaitable[Prepared]],
        allowance: FetchAllowance | None = None,
    ) -> Prepared:
        """The cached result for `key`, else `produce()`'s, kept once finished. Failures
        are not kept. A hit is charged to `allowance` as a fetch would be: it is inlined
        into the body all the same."""
        hit = self._cache.get(key)
        if hit is not None:
            if allowance is not None and hit.data is not None:
                allowance.take(len(hit.data))
            return _ready(hit)
        prepared = await produce()

        async def finish() -> Resolved:
            resolved = await prepared.finish()
            self._cache.put(key, resolved, resolved.held)
            return resolved

        return Prepared(prepared.pixels, finish)

    async def prepare_bytes(
        self,
        kind: MediaKind,
        data: bytes,
        declared: str | None,
        frames: Sequence[bytes] = (),
        *,
        owner: str,
        ref: DataUrl | None = None,
    ) -> Prepared:
        """Raw bytes declared as `declared` (a MIME type) for `kind`, checked up to their
        headers; decoding is left to `finish`, in `owner`'s turn of the decode line.
        `ref`: the data: URL the bytes came from, forwarded as sent when its form is
        already canonical and validation kept the bytes."""
        settings = self._settings
        if kind is MediaKind.image:
            # Header reads run on the decode pool too: a hostile file can make even
            # Image.open parse for a while, and the event loop must not wait for it.
            header = await self._decoder.run(read_header, data, declared, settings)
            return Prepared(header.pixels, lambda: self._decode_image(data, header, owner, ref))
        # Audio and video containers are checked, not decoded (gateway/media/av.py), on
        # the pool as well: the check scans up to 1 MiB of an item for FFmpeg's text
        # formats (about 10 ms at worst), and a request holds up to max_items of them.
        if kind is MediaKind.audio:
            audio = await self._decoder.run(validate_audio, data, declared, settings)
            return _ready(_inlined(audio.mime, audio.data))
        if frames:
            headers = await self._decoder.run(read_jpeg_frames, frames, settings)
            pixels = sum(h.pixels for h in headers)
            return Prepared(pixels, lambda: self._decode_frames(frames, headers, pixels, owner))
        video = await self._decoder.run(validate_video, data, declared, settings)
        return _ready(_inlined(video.mime, video.data))

    async def _decode_image(
        self, data: bytes, header: ImageHeader, owner: str, ref: DataUrl | None
    ) -> Resolved:
        cost = decode_cost(header, self._settings.validation)
        if cost:
            image = await self._decoder.decode(
                cost, owner, decode_image, data, header, self._settings
            )
        else:  # depth `header`: nothing to decode, nothing to hand to the pool
            image = decode_image(data, header, self._settings)
        if ref is not None and ref.canonical and image.data is data and ref.mime == image.mime:
            # The client's URL is the canonical one: kept as it is, so an unchanged body
            # is forwarded without being written again, and its digest is the one its
            # cache key took (hashing the decoded 1 MB again cost 0.8 ms).
            return Resolved(ref.url, image.mime, image.data, ref.digest, header.pixels)
        return _inlined(image.mime, image.data, header.pixels)

    async def _decode_frames(
        self, frames: Sequence[bytes], headers: Sequence[ImageHeader], pixels: int, owner: str
    ) -> Resolved:
        # Frames are decoded one after the other: the largest one is what is held.
        cost = max(decode_cost(h, self._settings.validation) for h in headers)
        video = await self._decoder.decode(
            cost, owner, decode_jpeg_frames, frames, headers, self._settings
        )
        return _video_jpeg(video, pixels)
