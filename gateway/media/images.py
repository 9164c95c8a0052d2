"""Image validation with Pillow: an explicit format list, caps that are errors, and a
declared type that must match the bytes.

`validate_image` is synchronous and CPU-bound: call it with `asyncio.to_thread`.
Depth (`MediaSettings.validation`): `header` reads only the header (size, format, frame
count); `decode` (default) also decodes every frame, which catches truncated and corrupt
files; `reencode` decodes and writes the image again, so the engine never sees the
client's bytes (metadata and trailing polyglot payloads are dropped).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from gateway.errors import MediaInvalid, MediaTooLarge
from gateway.media.settings import MediaSettings, ValidationDepth

# The MIME types each format may be declared as. vLLM ignores a data URL's type and
# lets Pillow sniff (docs/facts.md); the gateway insists they agree, so an SVG, HTML or
# PostScript file cannot hide behind an image label.
FORMAT_TYPES: dict[str, frozenset[str]] = {
    "PNG": frozenset({"image/png"}),
    "JPEG": frozenset({"image/jpeg", "image/jpg", "image/pjpeg"}),
    "WEBP": frozenset({"image/webp"}),
    "GIF": frozenset({"image/gif"}),
    "BMP": frozenset({"image/bmp", "image/x-ms-bmp"}),
    "TIFF": frozenset({"image/tiff"}),
}


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


def validate_image(
    data: bytes,
    declared: str | None,
    settings: MediaSettings,
    *,
    formats: Sequence[str] | None = None,
) -> ImageInfo:
    allowed = tuple(f.upper() for f in (formats or settings.image_formats))
    if len(data) > settings.max_bytes:
        raise MediaTooLarge("The image is larger than this gateway accepts.")
    mime = base_type(declared)
    if mime is None or not any(mime in FORMAT_TYPES.get(f, ()) for f in allowed):
        raise MediaInvalid("The declared media type is not an allowed image type.")
    try:
        return _inspect(data, mime, allowed, settings)
    except (MediaInvalid, MediaTooLarge):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaTooLarge("The image has more pixels than this gateway accepts.") from None
    except Exception:
        # Pillow raises OSError, SyntaxError, ValueError, struct.error, EOFError and more
        # for hostile files; its messages must not reach the client (gateway/errors.py).
        raise MediaInvalid("The image could not be read as an allowed format.") from None


def _inspect(
    data: bytes, mime: str, allowed: tuple[str, ...], settings: MediaSettings
) -> ImageInfo:
    with Image.open(io.BytesIO(data), formats=list(allowed)) as image:
        fmt = image.format or ""
        if mime not in FORMAT_TYPES.get(fmt, ()):
            raise MediaInvalid("The declared media type does not match the image's format.")
        width, height = image.size
        # Checked from the header before any decoding: a bomb is refused, not warned about.
        if width * height > settings.max_pixels:
            raise MediaTooLarge("The image has more pixels than this gateway accepts.")
        if min(width, height) < settings.min_dimension:
            raise MediaInvalid("The image is smaller than the minimum dimension.")
        frames = int(getattr(image, "n_frames", 1))
        if frames > settings.max_frames:
            raise MediaTooLarge("The image has more frames than this gateway accepts.")
        if settings.validation is ValidationDepth.header:
            return ImageInfo(fmt, mime, width, height, frames, data)
        for index in range(frames):
            image.seek(index)
            image.load()
        if settings.validation is ValidationDepth.decode:
            return ImageInfo(fmt, mime, width, height, frames, data)
        return ImageInfo(fmt, mime, width, height, frames, _reencode(image, fmt, frames))


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
