"""Image validation with Pillow: an explicit format list, caps that are errors, and a
declared type that must match the bytes.

Two steps, both synchronous (run them on the decode pool, gateway/media/decoder.py):
`read_header` opens the image and checks type and caps from its header alone;
`decode_image` then decodes it as deep as ``media.validation`` says, and
`decode_cost` is what that decode holds in memory, charged against the decode budget
before it starts.

Depth (``media.validation``):
- `header` reads only the header (size, format, frame count, mode).
- `decode` (default) also decodes every frame, which catches truncated and corrupt
  files. A single-frame JPEG is decoded at 1/8 scale (Pillow's `draft`): libjpeg still
  reads and entropy-decodes every coefficient of the file, so a truncated or corrupt
  scan fails as at full size; only the inverse DCT runs on fewer output pixels (a
  4000 x 4000 JPEG held 4 MiB instead of 65). PNG, GIF and WebP have no reduced decode
  in Pillow (`Image.reduce` works on an image already decoded), so they decode in full;
  a PNG whose decode is certain to succeed from its inflated rows alone
  (gateway/media/png.py) is not handed to Pillow's decode.
- `reencode` decodes every frame in full and writes the image again, so the engine never
  sees the client's bytes (metadata and trailing polyglot payloads are dropped).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar

from PIL import Image

from gateway.errors import MediaInvalid, MediaTooLarge
from gateway.media import png
from gateway.media.types import FORMAT_TYPES, ValidationDepth

P = ParamSpec("P")
T = TypeVar("T")


class ImageLimits(Protocol):
    """The media settings an image is checked against (`MediaSettings` has each)."""

    image_formats: list[str]
    max_bytes: int
    max_pixels: int
    min_dimension: int
    max_frames: int
    validation: ValidationDepth


# What a decode holds at its peak, in bytes per pixel of the image, measured on 4000 x
# 4000 images (VmHWM before and after one decode in a fresh process, Pillow 13): PNG and
# baseline JPEG 4.2 (Pillow keeps RGB and RGBA at 4 bytes a pixel; the rest is the
# decoder's and the file's), progressive JPEG 7.2 (libjpeg keeps every coefficient, 2
# bytes per sample, at any draft scale: 3 a pixel at 4:2:0, 6 at 4:4:4), WebP 16.5
# (libwebp's canvas and output, then Pillow's copy), a 3-frame GIF 13.2 (frames after
# the first become RGB, and the previous frame is kept for disposal). Re-encoding adds
# the output buffer.
_IMAGE = 5
_PROGRESSIVE = 6
_WEBP = 17
_ANIMATION = 14
_REENCODE = 4
# `draft` asks for 1/8 of each side; libjpeg scales by 1/2, 1/4 or 1/8.
_DRAFT = 8


@dataclass(frozen=True)
class ImageHeader:
    """What the header says, checked against the caps; nothing decoded yet."""

    format: str
    mime: str
    width: int
    height: int
    frames: int
    progressive: bool
    formats: tuple[str, ...]  # the formats the image was opened with

    @property
    def pixels(self) -> int:
        """Pixels a full decode produces: every frame counts."""
        return self.width * self.height * self.frames


@dataclass(frozen=True)
class ImageInfo:
    format: str
    mime: str
    width: int
    height: int
    frames: int
    data: bytes  # the validated bytes (re-encoded ones at depth `reencode`)


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """Validate the configured format list at start-up (ValueError if unknown)."""
    Image.init()
    out = tuple(f.upper() for f in formats)
    unknown = [f for f in out if f not in FORMAT_TYPES or f not in Image.OPEN]
    if unknown:
        raise ValueError(f"unsupported media image_formats: {unknown}")
    return out


def base_type(declared: str | None) -> str | None:
    if declared is None:
        return None
    return declared.split(";", 1)[0].strip().lower() or None


def _refusal(exc: Exception) -> MediaInvalid | MediaTooLarge:
    """The refusal for an exception met while reading an image."""
    if isinstance(exc, MediaInvalid | MediaTooLarge):
        return exc
    if isinstance(exc, Image.DecompressionBombError | Image.DecompressionBombWarning):
        return MediaTooLarge("The image has more pixels than this gateway accepts.")
    # Pillow raises OSError, SyntaxError, ValueError, struct.error, EOFError and more
    # for hostile files; its messages must not reach the client (gateway/errors.py).
    return MediaInvalid("The image could not be read as an allowed format.")


def _refusing(read: Callable[P, T]) -> Callable[P, T]:
    """`read`, with every exception it meets turned into a refusal. The refusal is raised
    bare: no context, no traceback of `read`, so nothing of Pillow's (its exception, the
    frames that held the image) lives on with it until the cyclic collector runs: for a
    refused 4096 x 4096 image, 64 MiB a refusal (docs/facts.md, "Media memory")."""

    @functools.wraps(read)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return read(*args, **kwargs)
        except Exception as exc:
            refusal = _refusal(exc)
        refusal.__context__ = None
        try:
            raise refusal.with_traceback(None)
        finally:
            del refusal  # this frame would hold the refusal that holds this frame

    return call


@contextmanager
def _opened(data: bytes, formats: Sequence[str]) -> Iterator[Image.Image]:
    """The image in `data`, its pixels released on the way out however it is left."""
    image = Image.open(io.BytesIO(data), formats=list(formats))
    try:
        yield image
    finally:
        image.close()  # destroys the decoded core, not only the file


@_refusing
def read_header(
    data: bytes,
    declared: str | None,
    settings: ImageLimits,
    *,
    formats: Sequence[str] | None = None,
) -> ImageHeader:
    """Type and caps checked from the header (MediaInvalid, MediaTooLarge)."""
    allowed = tuple(f.upper() for f in (formats or settings.image_formats))
    if len(data) > settings.max_bytes:
        raise MediaTooLarge("The image is larger than this gateway accepts.")
    mime = base_type(declared)
    if mime is None or not any(mime in FORMAT_TYPES.get(f, ()) for f in allowed):
        raise MediaInvalid("The declared media type is not an allowed image type.")
    _check_structure(data)
    with _opened(data, allowed) as image:
        fmt = image.format or ""
        if mime not in FORMAT_TYPES.get(fmt, ()):
            raise MediaInvalid("The declared media type does not match the image's format.")
        width, height = image.size
        # Checked from the header before any decoding: a bomb is refused, not warned about.
        if width * height > settings.max_pixels:
            raise MediaTooLarge("The image has more pixels than this gateway accepts.")
        if min(width, height) < settings.min_dimension:
            raise MediaInvalid("The image is smaller than the minimum dimension.")
        if fmt == "GIF":
            frames = gif_frames(data, image.size, settings.max_frames)
        else:
            frames = int(getattr(image, "n_frames", 1))
        if frames > settings.max_frames:
            raise MediaTooLarge("The image has more frames than this gateway accepts.")
        progressive = bool(image.info.get("progressive") or image.info.get("progression"))
        return ImageHeader(fmt, mime, width, height, frames, progressive, allowed)


# Markers before a JPEG's first scan, and bytes there that are no marker (fill bytes,
# junk), that Pillow's parser is let walk; real files have some tens of markers and a
# few fill bytes. A PNG's chunks: 1,024 and one for every KiB of the file.
_JPEG_MARKERS = 1024
_JPEG_JUNK = 4096
# Scans of a JPEG (its SOS markers, counted in every byte: entropy-coded data never
# holds one, metadata rarely). libjpeg runs a pass over the whole coefficient buffer
# for each, and sets no limit of its own: at 4095 x 4095, 12 ms a scan (100 repeated
# 33-byte scans: 1.24 s), so 10,000 in a 430 KB file hold a decode thread about two
# minutes. Real progressive files have about ten.
_JPEG_SCANS = 100
_PNG_CHUNKS = 1024


def _check_structure(data: bytes) -> None:
    """MediaInvalid for a JPEG or PNG with more metadata segments than any real file
    has, before Pillow parses it. Pillow walks a JPEG's markers up to its first scan,
    and a PNG's chunks, in Python (~1-3 us each), stepping over a JPEG's junk a byte at
    a time and keeping every comment and private chunk: a 20 MB JPEG of 5 million empty
    comments takes 5 s of a decode thread and ~370 MiB to read its header, outside the
    decode budget (docs/facts.md, "Media memory")."""
    end = len(data)
    if data[:2] == b"\xff\xd8":
        at, markers, junk = 2, 0, 0
        while at + 1 < end:
            if data[at] != 0xFF:
                found = data.find(b"\xff", at)
                found = end if found < 0 else found
                junk += found - at
                at = found
            elif data[at + 1] in (0x00, 0xFF):  # an escaped 0xFF, a fill byte
                junk += 1
                at += 1 if data[at + 1] == 0xFF else 2
            else:
                marker = data[at + 1]
                markers += 1
                if marker in (0xD9, 0xDA) or markers > _JPEG_MARKERS:  # EOI, SOS
                    break
                standalone = marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7
                at += 2 if standalone else 2 + int.from_bytes(data[at + 2 : at + 4], "big")
            if junk > _JPEG_JUNK:
                break
        if markers > _JPEG_MARKERS or junk > _JPEG_JUNK:
            raise MediaInvalid("The image's header has more segments than this gateway reads.")
        if data.count(b"\xff\xda") > _JPEG_SCANS:
            raise MediaInvalid("The image has more scans than this gateway decodes.")
    elif data[:8] == png.SIGNATURE:
        cap = _PNG_CHUNKS + end // 1024
        for count, (kind, _, _) in enumerate(png.chunks(data), 1):
            if count > cap:
                raise MediaInvalid("The image has more chunks than this gateway reads.")
            if kind == b"IEND":
                break


def gif_frames(data: bytes, size: tuple[int, int], cap: int) -> int:
    """The frames of a GIF, walked as Pillow 13 walks them (`GifImageFile._seek`), but
    only up to `cap + 1` (returned once there are more than `cap`). MediaInvalid for a
    frame that reaches outside `size`, the image's size as opened (its logical screen,
    grown to its first frame), or for a walk that ends inside a block.

    Pillow's own count (`n_frames`) walks every frame before the cap is looked at: a 20
    MiB GIF of 1.3 million 1 x 1 frames takes ~2 s of a decode thread. And a decode grows
    the image to each frame's extent as it goes, past the caps the header was checked
    against and the budget charged for it (docs/facts.md, "Media memory")."""
    width, height = size
    end = len(data)
    flags = data[10] if end > 10 else 0
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)

    def blocks(at: int) -> int:
        """Past the data sub-blocks at `at` (Pillow: `while self.data(): pass`)."""
        while at < end:
            length = data[at]
            at += 1 + length
            if length == 0:
                return at
        return at

    frames = 0
    while frames <= cap and at < end:
        byte = data[at]
        at += 1
        if byte == 0x3B:  # the trailer
            break
        if byte == 0x21:  # an extension: its label, then its sub-blocks
            if at >= end:
                raise MediaInvalid("The image could not be read as an allowed format.")
            at = blocks(at + 1)
        elif byte == 0x2C:  # an image: its descriptor, a local palette, the LZW data
            if at + 10 > end:
                raise MediaInvalid("The image could not be read as an allowed format.")
            x0, y0, w, h = (
                int.from_bytes(data[at + i : at + i + 2], "little") for i in (0, 2, 4, 6)
            )
            local = data[at + 8]
            at += 9 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1
            at = blocks(at)
            if x0 + w > width or y0 + h > height:
                raise MediaInvalid("A frame of the image lies outside the image.")
            frames += 1
        # Any other byte is stepped over, as Pillow does.
    return max(frames, 1)


def _draft_scale(header: ImageHeader) -> int:
    """The scale `draft` will pick for a single-frame JPEG (Pillow's own rule), else 1."""
    if header.format != "JPEG" or header.frames != 1:
        return 1
    w, h = header.width, header.height
    fit = min(w // max(1, w // _DRAFT), h // max(1, h // _DRAFT))
    return next(s for s in (8, 4, 2, 1) if s <= fit)


def decode_cost(header: ImageHeader, depth: ValidationDepth) -> int:
    """Bytes a decode of this image at `depth` holds at its peak (0 at `header`)."""
    if depth is ValidationDepth.header:
        return 0
    w, h = header.width, header.height
    scale = _draft_scale(header) if depth is ValidationDepth.decode else 1
    out_w, out_h = -(-w // scale), -(-h // scale)
    if header.format == "WEBP":
        cost = _WEBP * w * h
    elif header.frames > 1:
        cost = _ANIMATION * w * h
    else:
        cost = _IMAGE * out_w * out_h
        if header.format == "JPEG" and header.progressive:
            cost += _PROGRESSIVE * w * h
    if depth is ValidationDepth.reencode:
        cost += _REENCODE * w * h
    return cost


def worst_cost(settings: ImageLimits) -> int:
    """The most one item allowed by `settings` can be charged: a square image at
    `max_pixels` in the costliest allowed format, frame count and JPEG kind."""
    side = max(1, math.isqrt(settings.max_pixels))
    frames = (1, 2) if settings.max_frames > 1 else (1,)
    return max(
        decode_cost(ImageHeader(f.upper(), "", side, side, n, progressive, ()), settings.validation)
        for f in settings.image_formats
        for n in frames
        for progressive in (False, True)
    )


@_refusing
def decode_image(data: bytes, header: ImageHeader, settings: ImageLimits) -> ImageInfo:
    """Decode `data` (whose header `read_header` passed) as deep as the settings say."""
    depth = settings.validation
    fmt, mime = header.format, header.mime
    if depth is ValidationDepth.header:
        return ImageInfo(fmt, mime, header.width, header.height, header.frames, data)
    with _opened(data, header.formats) as image:
        if image.format != fmt or image.size != (header.width, header.height):
            raise MediaInvalid("The image could not be read as an allowed format.")
        if depth is ValidationDepth.decode and png.decodes(data, image):
            return ImageInfo(fmt, mime, header.width, header.height, header.frames, data)
        scale = _draft_scale(header) if depth is ValidationDepth.decode else 1
        if scale > 1:
            image.draft(image.mode, (header.width // scale, header.height // scale))
        size = image.size
        for index in range(header.frames):
            image.seek(index)
            # Pillow grows a GIF to a frame that reaches past it as it seeks there, before
            # the frame's pixels are allocated: the decode budget is charged for `size`.
            # gif_frames refuses such frames from the header; this is Pillow's own view.
            if image.size != size:
                raise MediaInvalid("A frame of the image lies outside the image.")
            image.load()
        if depth is ValidationDepth.decode:
            return ImageInfo(fmt, mime, header.width, header.height, header.frames, data)
        out = _reencode(image, fmt, header.frames)
        return ImageInfo(fmt, mime, header.width, header.height, header.frames, out)


def _reencode(image: Image.Image, fmt: str, frames: int) -> bytes:
    out = io.BytesIO()
    image.seek(0)
    if frames > 1:
        image.save(out, format=fmt, save_all=True)
    elif fmt == "JPEG":
        image.save(out, format=fmt, quality=95)
    else:
        image.save(out, format=fmt)
    return out.getvalue()
