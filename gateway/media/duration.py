"""How long an audio or video item plays, read from its container's headers (never by
decoding): what the engine will decode, and resample, in full.

- WAV: the frames the `data` chunk holds (its bytes present, by the `fmt ` chunk's block
  size) over the sample rate: what a decoder reads, whatever byte rate the header
  claims. A 1 Hz sample rate makes a small file days long.
- MP3: the MPEG frames walked from the first to the last (their samples over their
  rates); bytes after the walk stops are charged as frames at 8 kbit/s, the lowest bit
  rate, since a decoder resynchronises on any frame it finds in them.
- FLAC: STREAMINFO's total samples over its sample rate (0, unknown: None).
- MP4, M4A, MOV: the movie header's (`mvhd`) duration over its time scale.
- Others (Ogg, WebM): None, unknown; such items are bounded by `media.max_bytes` only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from gateway.media.mpeg import RATES, id3_length, mpeg_frame

_MIN_BITS_PER_SECOND = 8000


def _wav(data: bytes) -> float | None:
    at, rate, block = 12, 0, 0
    while at + 8 <= len(data):
        name, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        if name == b"fmt " and size >= 16:
            _, _, rate, _, block = struct.unpack_from("<HHIIH", data, at + 8)
        elif name == b"data":
            if not rate or not block:
                return None
            held = min(size, len(data) - at - 8)
            return held / block / rate
        at += 8 + size + (size & 1)
    return None


def _samples_per_frame(header: int) -> int:
    version, layer = (header >> 19) & 3, (header >> 17) & 3
    if layer == 3:  # layer I
        return 384
    if layer == 1 and version != 3:  # layer III outside MPEG-1
        return 576
    return 1152


def _mp3(data: bytes) -> float:
    at = max(id3_length(data), 0)
    seconds = 0.0
    while (frame := mpeg_frame(data, at)) is not None:
        header, length = frame
        rate = RATES[(header >> 19) & 3][(header >> 10) & 3]
        seconds += _samples_per_frame(header) / rate
        at += length
    rest = len(data) - at
    if data[-128:-125] == b"TAG" and rest >= 128:  # an ID3v1 tag: not audio
        rest -= 128
    return seconds + rest * 8 / _MIN_BITS_PER_SECOND


def _flac(data: bytes) -> float | None:
    if len(data) < 8 + 34:
        return None
    rate = int.from_bytes(data[18:21], "big") >> 4
    total = int.from_bytes(data[21:26], "big") & ((1 << 36) - 1)
    return total / rate if rate and total else None


def _iso(data: bytes) -> float | None:
    """The `mvhd` box inside the top-level `moov` box (wherever it sits in the file)."""

    def boxes(start: int, end: int) -> list[tuple[bytes, int, int]]:
        out: list[tuple[bytes, int, int]] = []
        at = start
        while at + 8 <= end and len(out) < 64:
            size, name = int.from_bytes(data[at : at + 4], "big"), data[at + 4 : at + 8]
            body = at + 8
            if size == 1:
                size, body = int.from_bytes(data[at + 8 : at + 16], "big"), at + 16
            elif size == 0:
                size = end - at
            if size < body - at or at + size > end:
                break
            out.append((name, body, at + size))
            at += size
        return out

    for name, body, end in boxes(0, len(data)):
        if name != b"moov":
            continue
        for inner, start, stop in boxes(body, end):
            if inner != b"mvhd" or stop - start < 32:
                continue
            if data[start] == 1:
                scale, length = struct.unpack_from(">IQ", data, start + 20)
            else:
                scale, length = struct.unpack_from(">II", data, start + 12)
            return length / scale if scale else None
    return None


_DURATION: dict[str, Callable[[bytes], float | None]] = {
    "wav": _wav,
    "mp3": _mp3,
    "flac": _flac,
    "mp4": _iso,
    "m4a": _iso,
    "mov": _iso,
}


def duration(format_name: str, data: bytes) -> float | None:
    """Seconds `data` (a well-formed container of `format_name`) plays; None when its
    headers do not say."""
    read = _DURATION.get(format_name)
    return None if read is None else read(data)
