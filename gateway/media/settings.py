"""Settings of the media policy (`GATEWAY_MEDIA__...`).

Every check in docs/media.md names the setting here that controls it. Defaults deny:
no remote domains, https only, no non-public networks, no dangerous fields.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field, FilePath


class MediaMode(StrEnum):
    inline = "inline"
    passthrough = "passthrough"
    data_only = "data_only"


class ValidationDepth(StrEnum):
    header = "header"
    decode = "decode"
    reencode = "reencode"


class UuidPolicy(StrEnum):
    # Rewrite a client's media `uuid` into a per-key namespace (sha256 of key name + uuid).
    namespace = "namespace"
    # Remove it; a part that names media only by uuid is then refused.
    drop = "drop"


class MediaSettings(BaseModel):
    mode: MediaMode = MediaMode.inline
    allowed_domains: list[str] = Field(default_factory=list)
    allowed_schemes: list[str] = Field(default_factory=lambda: ["https"])
    allowed_networks: list[str] = Field(default_factory=list)
    max_url_length: int = Field(default=4096, gt=0)
    max_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    fetch_timeout: float = Field(default=10.0, gt=0)
    max_concurrent_fetches: int = Field(default=16, gt=0)
    # PEM file of the CAs trusted for https media origins, instead of the default trust
    # store (an internal CA). Must exist when the settings are read.
    ca_file: FilePath | None = None
    # Media items one request may carry (each may cost a fetch and a decode).
    max_items: int = Field(default=32, gt=0)
    validation: ValidationDepth = ValidationDepth.decode
    image_formats: list[str] = Field(default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF"])
    max_pixels: int = Field(default=40_000_000, gt=0)
    max_frames: int = Field(default=64, gt=0)
    min_dimension: int = Field(default=1, ge=1)
    audio_formats: list[str] = Field(default_factory=lambda: ["wav", "mp3", "flac", "ogg"])
    video_formats: list[str] = Field(default_factory=lambda: ["mp4", "webm"])
    # Fetched, validated media kept by canonical URL, bounded in bytes and age.
    cache_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    cache_ttl: float = Field(default=300.0, ge=0)
    uuids: UuidPolicy = UuidPolicy.namespace
    max_cache_salt_length: int = Field(default=256, ge=0)
    # Explicit opt-ins for request fields that vLLM trusts too much (docs/facts.md).
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
