"""Settings of the media policy (`GATEWAY_MEDIA__...`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class MediaMode(StrEnum):
    inline = "inline"
    passthrough = "passthrough"
    data_only = "data_only"


class ValidationDepth(StrEnum):
    header = "header"
    decode = "decode"
    reencode = "reencode"


class MediaSettings(BaseModel):
    mode: MediaMode = MediaMode.inline
    allowed_domains: list[str] = Field(default_factory=list)
    allowed_schemes: list[str] = Field(default_factory=lambda: ["https"])
    allowed_networks: list[str] = Field(default_factory=list)
    max_url_length: int = 4096
    max_bytes: int = 20 * 1024 * 1024
    fetch_timeout: float = 10.0
    max_concurrent_fetches: int = 16
    validation: ValidationDepth = ValidationDepth.decode
    image_formats: list[str] = Field(default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF"])
    max_pixels: int = 40_000_000
    max_frames: int = 64
    min_dimension: int = 1
