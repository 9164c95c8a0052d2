"""Settings of the media policy (`GATEWAY_MEDIA__...`).

Every check in docs/media.md names the setting here that controls it. Defaults deny:
no remote domains, https only, no non-public networks, no dangerous fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.config.tls import check_ca_file
from gateway.errors import MediaUrlNotAllowed
from gateway.media.addresses import parse_networks
from gateway.media.images import check_formats, worst_cost
from gateway.media.types import AUDIO_TYPES, VIDEO_TYPES, MediaMode, UuidPolicy, ValidationDepth
from gateway.media.urls import parse_domain_rule


def check_domain(entry: str) -> str:
    """Raise ValueError unless `entry` is an allowed_domains entry the URL policy reads."""
    try:
        parse_domain_rule(entry)
    except MediaUrlNotAllowed as exc:
        # The message names the rule that refused it (rule: scheme, port, host, ...).
        reason = exc.message.removeprefix("Media URL refused").rstrip(".")
        raise ValueError(
            f"not a domain entry{reason}; an entry is `host`, `*.host`, `host:port` or `[v6]:port`"
        ) from None
    return entry


class MediaSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: MediaMode = MediaMode.inline
    # Each read by the parser the URL policy uses (`check_domain`).
    allowed_domains: list[Annotated[str, AfterValidator(check_domain)]] = Field(
        default_factory=list
    )
    allowed_schemes: list[str] = Field(default_factory=lambda: ["https"])
    allowed_networks: list[str] = Field(default_factory=list)
    max_url_length: int = Field(default=4096, gt=0)
    max_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    # Bytes one request's media URLs may bring in, summed over its items as they stream
    # in (a cached item counts its size too); 413 media_too_large beyond. Each is
    # inlined into the forwarded body: 32 URLs of 19 MiB files took the gateway to
    # 1.8 GB for one request. As much as a whole request body (limits.max_body_bytes).
    max_request_fetch_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    fetch_timeout: float = Field(default=10.0, gt=0)
    max_concurrent_fetches: int = Field(default=16, gt=0)
    # PEM file of the CAs trusted for https media origins, instead of the default trust
    # store (an internal CA). Must exist when the settings are read.
    ca_file: FilePath | None = None
    # Media items one request may carry (each may cost a fetch and a decode).
    max_items: int = Field(default=32, gt=0)
    validation: ValidationDepth = ValidationDepth.decode
    image_formats: list[str] = Field(default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF"])
    # Pixels of one image (width x height, from the header, before decoding). 4096 x 4096:
    # the largest image the common vision models' processors take before they downscale
    # (Qwen3-VL's published preprocessor config: 16,777,216; Qwen2/2.5-VL's: 12,845,056;
    # transformers' Qwen2-VL default: 1,003,520); more pixels only cost the gateway and
    # the engine memory: 40 M pixels are 160 MiB decoded per RGBA image (docs/media.md,
    # "Media memory").
    max_pixels: int = Field(default=4096 * 4096, gt=0)
    # Decoded pixels one request may carry: width x height x frames summed over its
    # images (and `data:video/jpeg` frames), from the headers, before anything is
    # decoded (413 media_too_large). 8 images at the cap.
    max_request_pixels: int = Field(default=8 * 4096 * 4096, gt=0)
    # Threads that decode images: a pool of its own, so at most this many decodes (and
    # their buffers) exist at once, whatever the host's core count.
    decode_threads: int = Field(default=2, gt=0)
    # Bytes of decoded image buffers the whole process may hold at once. Each decode is
    # charged what it holds at its peak (gateway/media/images.py, `decode_cost`, measured:
    # 5 bytes a pixel for PNG, 17 for WebP, more for progressive JPEG, animations and
    # re-encoding; a JPEG at depth `decode` is decoded at 1/8 scale) and waits for its
    # share and a thread in a line shared fairly between keys (gateway/media/budget.py).
    # Must hold the costliest single item the other settings allow (checked at start).
    # 384 MiB holds one 4096 x 4096 item of any allowed kind at any depth (a re-encoded
    # WebP is the costliest: 21 bytes a pixel, 336 MiB), or several smaller ones.
    decode_budget_bytes: int = Field(default=384 * 1024 * 1024, gt=0)
    # Seconds a decode may wait for its share of the budget and a thread before the
    # request is refused with 503 media_busy (and Retry-After). Generous: two requests of
    # 8 images at the pixel cap wait ~2 s for their last decode on 2 idle cores, and
    # several times that on busy ones.
    decode_wait: float = Field(default=20.0, gt=0)
    max_frames: int = Field(default=64, gt=0)
    min_dimension: int = Field(default=1, ge=1)
    audio_formats: list[str] = Field(default_factory=lambda: ["wav", "mp3", "flac", "ogg"])
    video_formats: list[str] = Field(default_factory=lambda: ["mp4", "webm"])
    # Seconds one audio or video item may play, read from its container's headers
    # (gateway/media/duration.py: WAV, MP3, FLAC, MP4/M4A/MOV); 413 media_too_large
    # beyond. The engine decodes the whole item: 20 MiB of 8 kbit/s MP3 are almost 6
    # hours of samples. 10 minutes: Whisper-style models take 30 s windows, the audio
    # chat models a few minutes.
    max_audio_seconds: float = Field(default=600.0, gt=0)
    max_video_seconds: float = Field(default=600.0, gt=0)
    # An item whose headers do not say how long it plays (Ogg, WebM, a FLAC without its
    # sample count, a WAV codec the gateway cannot count) is refused with 413
    # media_duration_unknown: no byte rate bounds it (an Opus stream of 1-byte packets
    # plays hours a MiB). True: such items are bounded by max_bytes alone, and an upload
    # is weighed as if it played max_audio_seconds.
    allow_unknown_duration: bool = False
    # Seconds of audio each engine request of a transcription or translation covers
    # at least: vLLM cuts longer audio into clips of `max_audio_clip_s` (Whisper: 30 s)
    # at a quiet point of the last `overlap_chunk_second` (1 s) and runs every clip at
    # once, so a file makes at most ceil(seconds / 29) requests (gateway/payload/
    # sequences.py). Lower it for an engine whose model takes shorter clips.
    audio_clip_seconds: float = Field(default=29.0, gt=0)
    # Fetched, validated media kept by canonical URL, bounded in bytes and age.
    cache_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    cache_ttl: float = Field(default=300.0, ge=0)
    uuids: UuidPolicy = UuidPolicy.namespace
    max_cache_salt_length: int = Field(default=256, ge=0)
    # Explicit opt-ins for request fields that vLLM trusts too much (docs/vllm.md).
    allow_prompt_embeds: bool = False
    allow_embeds_parts: bool = False
    allow_kv_transfer_params: bool = False
    allow_ec_transfer_params: bool = False
    allow_media_io_kwargs: bool = False
    allow_mm_processor_kwargs: bool = False
    allow_chat_template: bool = False
    # Multipart audio uploads (/v1/audio/transcriptions, /translations).
    upload_max_parts: int = Field(default=16, gt=0)
    upload_max_field_bytes: int = Field(default=64 * 1024, gt=0)

    # Each list is read here by the code that uses it at serving time, so an entry it
    # cannot use is refused when the settings load, not when the gateway starts.

    @field_validator("ca_file")
    @classmethod
    def _check_ca(cls, path: Path | None) -> Path | None:
        return check_ca_file(path)

    @field_validator("allowed_schemes")
    @classmethod
    def _check_schemes(cls, schemes: list[str]) -> list[str]:
        unknown = sorted({s.lower() for s in schemes} - {"http", "https"})
        if unknown:
            raise ValueError(f"only http and https can be fetched, not {', '.join(unknown)}")
        return schemes

    @field_validator("allowed_networks")
    @classmethod
    def _check_networks(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            try:
                parse_networks([entry])
            except ValueError:
                raise ValueError(
                    f"{entry.strip()!r} is not a network such as 10.0.0.0/8 or fd00::/8 "
                    "(no host bits set)"
                ) from None
        return entries

    @field_validator("image_formats")
    @classmethod
    def _check_image_formats(cls, formats: list[str]) -> list[str]:
        check_formats(formats)
        return formats

    @field_validator("audio_formats", "video_formats")
    @classmethod
    def _check_av_formats(cls, formats: list[str], info: ValidationInfo) -> list[str]:
        table = AUDIO_TYPES if info.field_name == "audio_formats" else VIDEO_TYPES
        unknown = [f for f in formats if f not in table]
        if unknown:
            raise ValueError(
                f"unknown formats {', '.join(unknown)}; known: {', '.join(sorted(table))}"
            )
        return formats

    @model_validator(mode="after")
    def _budget_fits_an_item(self) -> Self:
        # An item the budget can never hold would wait decode_wait, then fail, every time.
        worst = worst_cost(self)
        if self.decode_budget_bytes < worst:
            raise ValueError(
                f"media.decode_budget_bytes must hold the costliest item the other media "
                f"settings allow: at least {worst}"
            )
        return self
