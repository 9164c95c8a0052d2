"""Audio and video checks: a type allowlist, magic bytes that match the declared type,
size caps, and a frame cap for `data:video/jpeg` (comma-separated base64 JPEG frames,
the form vLLM decodes frame by frame, docs/vllm.md).

The gateway does not decode audio or video (that needs codecs it should not carry);
it guarantees that only the allowed container formats reach the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import MediaInvalid, MediaTooLarge
from gateway.media.images import ImageHeader, base_type, decode_image, read_header
from gateway.media.settings import MediaSettings

AUDIO_TYPES: dict[str, frozenset[str]] = {
    "wav": frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"}),
    "mp3": frozenset({"audio/mpeg", "audio/mp3"}),
    "flac": frozenset({"audio/flac", "audio/x-flac"}),
    "ogg": frozenset({"audio/ogg"}),
    "m4a": frozenset({"audio/mp4", "audio/m4a", "audio/x-m4a"}),
    "webm": frozenset({"audio/webm"}),
}
VIDEO_TYPES: dict[str, frozenset[str]] = {
    "mp4": frozenset({"video/mp4"}),
    "webm": frozenset({"video/webm"}),
    "mkv": frozenset({"video/x-matroska"}),
    "mov": frozenset({"video/quicktime"}),
}


@dataclass(frozen=True)
class AvInfo:
    format: str
    mime: str
    data: bytes
    frames: tuple[bytes, ...] = ()  # the JPEG frames of `video/jpeg`


def sniff(data: bytes) -> str | None:
    """The container format named by the magic bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"  # EBML: WebM and Matroska share it
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if brand in (b"M4A ", b"M4B "):
            return "m4a"
        if brand == b"qt  ":
            return "mov"
        return "mp4"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _compatible(sniffed: str, declared_format: str) -> bool:
    if sniffed == declared_format:
        return True
    # MP4 and M4A share the ISO container; Matroska and WebM share EBML.
    return {sniffed, declared_format} in ({"mp4", "m4a"}, {"webm", "mkv"}, {"mp4", "mov"})


def _validate(
    data: bytes,
    declared: str | None,
    table: dict[str, frozenset[str]],
    allowed: Sequence[str],
    settings: MediaSettings,
) -> AvInfo:
    if len(data) > settings.max_bytes:
        raise MediaTooLarge("The media item is larger than this gateway accepts.")
    mime = base_type(declared)
    names = [name for name in allowed if mime is not None and mime in table.get(name, ())]
    if not names:
        raise MediaInvalid("The declared media type is not allowed.")
    sniffed = sniff(data)
    if sniffed is None or not any(_compatible(sniffed, name) for name in names):
        raise MediaInvalid("The media bytes do not match the declared type.")
    return AvInfo(names[0], mime or "", data)


def validate_audio(data: bytes, declared: str | None, settings: MediaSettings) -> AvInfo:
    return _validate(data, declared, AUDIO_TYPES, settings.audio_formats, settings)


def audio_type(format_name: object) -> str | None:
    """The MIME type for an `input_audio.format` value ("wav", "mp3", ...)."""
    if not isinstance(format_name, str):
        return None
    types = AUDIO_TYPES.get(format_name.lower())
    return min(types) if types else None


def validate_video(
    data: bytes, declared: str | None, settings: MediaSettings, frames: Sequence[bytes] = ()
) -> AvInfo:
    if base_type(declared) == "video/jpeg":
        return validate_jpeg_frames(frames, settings)
    return _validate(data, declared, VIDEO_TYPES, settings.video_formats, settings)


def read_jpeg_frames(frames: Sequence[bytes], settings: MediaSettings) -> list[ImageHeader]:
    """The headers of a `data:video/jpeg` URL's frames, each checked as a JPEG's, and the
    frame and size caps. Synchronous (Pillow)."""
    if not frames:
        raise MediaInvalid("The video has no frames.")
    if len(frames) > settings.max_frames:
        raise MediaTooLarge("The video has more frames than this gateway accepts.")
    if sum(len(f) for f in frames) > settings.max_bytes:
        raise MediaTooLarge("The media item is larger than this gateway accepts.")
    return [read_header(f, "image/jpeg", settings, formats=("JPEG",)) for f in frames]


def decode_jpeg_frames(
    frames: Sequence[bytes], headers: Sequence[ImageHeader], settings: MediaSettings
) -> AvInfo:
    """The frames decoded one after the other (one frame's buffer at a time)."""
    checked = [decode_image(f, h, settings).data for f, h in zip(frames, headers, strict=True)]
    return AvInfo("jpeg", "video/jpeg", b"".join(checked), tuple(checked))


def validate_jpeg_frames(frames: Sequence[bytes], settings: MediaSettings) -> AvInfo:
    """Frames of a `data:video/jpeg` URL; each must be a JPEG. Synchronous (Pillow)."""
    return decode_jpeg_frames(frames, read_jpeg_frames(frames, settings), settings)
