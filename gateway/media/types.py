"""The media kinds, modes and format tables that the settings, the parsers, the body walk
and routing all read: values only, importing nothing of the gateway."""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class MediaMode(StrEnum):
    inline = "inline"
    passthrough = "passthrough"
    data_only = "data_only"


class ValidationDepth(StrEnum):
    header = "header"
    decode = "decode"
    reencode = "reencode"


class UuidPolicy(StrEnum):
    # Rewrite a client's media `uuid` into a per-key namespace (an HMAC of the key's digest
    # and the uuid: gateway/payload/identity.py).
    namespace = "namespace"
    # Remove it; a part that names media only by uuid is then refused.
    drop = "drop"


class MediaKind(StrEnum):
    image = "image"
    audio = "audio"
    video = "video"


# Keys whose value vLLM reads as media (a URL string, `{"url": ...}`, or a list of
# them), with the kind they carry. None: a file-like input the gateway never serves.
MEDIA_KEYS: Final[dict[str, MediaKind | None]] = {
    "image_url": MediaKind.image,
    "input_image": MediaKind.image,
    "image": MediaKind.image,
    "image_pil": MediaKind.image,
    "images": MediaKind.image,  # /v2/embed, /v1/systemone
    "video_url": MediaKind.video,
    "video": MediaKind.video,
    "videos": MediaKind.video,
    "audio_url": MediaKind.audio,
    "audio": MediaKind.audio,
    "audios": MediaKind.audio,
    "input_audio": MediaKind.audio,  # {"data": base64, "format": ...}
    "file": None,
    "file_url": None,
    "file_data": None,
    "file_id": None,
    "input_file": None,
}
# Anthropic-style `{"type": ..., "source": {"type": "url"|"base64", ...}}` (/v1/messages).
SOURCE_KEY: Final = "source"
# Part types that make an object a media part even when no media key is set (a uuid-only
# reference to a cached item, or an embeds part).
MEDIA_TYPES: Final = frozenset(
    {"image_url", "input_image", "image", "image_pil", "video_url", "video", "audio_url",
     "audio", "input_audio", "file", "input_file", "document", "image_embeds",
     "audio_embeds", "video_embeds", "prompt_embeds"}
)  # fmt: skip

# The MIME types each format may be declared as. vLLM ignores a data URL's type and
# lets Pillow sniff (docs/vllm.md); the gateway insists they agree, so an SVG, HTML or
# PostScript file cannot hide behind an image label.
FORMAT_TYPES: dict[str, frozenset[str]] = {
    "PNG": frozenset({"image/png"}),
    "JPEG": frozenset({"image/jpeg", "image/jpg", "image/pjpeg"}),
    "WEBP": frozenset({"image/webp"}),
    "GIF": frozenset({"image/gif"}),
    "BMP": frozenset({"image/bmp", "image/x-ms-bmp"}),
    "TIFF": frozenset({"image/tiff"}),
}

# The MIME types each audio and video format may be declared as.
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
