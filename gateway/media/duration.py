"""How long an audio or video item plays, read from its container's headers (never by
decoding): what the engine will decode, and resample, in full.

- WAV: the samples held after the `data` chunk's header, to the end of the file
  (FFmpeg reads a second `data` chunk after the first), over the sample rate: what a
  decoder reads, whatever byte rate the header claims. A 1 Hz sample rate makes a small
  file days long. PCM, float, A-law and mu-law: a frame is a sample of each channel;
  IMA and Microsoft ADPCM: each block holds the samples a decoder makes of it (or the
  header's `wSamplesPerBlock` where larger). Any other codec: None (a 5 MiB IMA-ADPCM
  file counted in blocks read 2.6 s and plays 1,293 s: a codec not counted is unknown).
- MP3: the MPEG frames walked from the first to the last (their samples over their
  rates); bytes after the walk stops are charged as frames at 8 kbit/s, the lowest bit
  rate, since a decoder resynchronises on any frame it finds in them.
- FLAC: STREAMINFO's total samples over its sample rate (0, unknown: None).
- MP4, M4A, MOV: the movie header's (`mvhd`) duration over its time scale.
- Others (Ogg, WebM): None, unknown. An unknown duration is refused unless
  `media.allow_unknown_duration` (gateway/media/av.py).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from gateway.media.mpeg import RATES, id3_length, mpeg_frame

_MIN_BITS_PER_SECOND = 8000


# WAV format tags whose samples the gateway counts (RFC 2361): a frame is one sample of
# each channel for PCM, IEEE float, A-law and mu-law; ADPCM blocks hold a header per
# channel (IMA: 4 bytes, one sample; Microsoft: 7 bytes, two samples), then codes.
_WAV_FRAMES = {0x0001, 0x0003, 0x0006, 0x0007}
_WAV_IMA_ADPCM, _WAV_MS_ADPCM, _WAV_EXTENSIBLE = 0x0011, 0x0002, 0xFFFE


def _wav_samples_per_block(tag: int, fmt: bytes) -> tuple[int, int] | None:
    """(bytes, samples) of one block of a `fmt ` chunk's codec, or None for a codec
    not counted. Per channel for ADPCM, as FFmpeg's decoders count a block; the
    header's `wSamplesPerBlock` where larger (libsndfile reads it)."""
    _, channels, _, _, block, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag in _WAV_FRAMES:
        # The smaller of the block size and the samples' width: a decoder reads the
        # latter, and a header claiming wide blocks would shorten the count.
        frame = max(channels, 1) * max((bits + 7) // 8, 1)
        return min(block, frame) if block else frame, 1
    if tag not in (_WAV_IMA_ADPCM, _WAV_MS_ADPCM):
        return None
    # IMA: 2 to 5 bits a code (FFmpeg), another width counted at the narrowest; MS: 4.
    ima = tag == _WAV_IMA_ADPCM
    header, first, width = (4, 1, bits if 2 <= bits <= 5 else 2) if ima else (7, 2, 4)
    if not channels or block <= header * channels:
        return None
    samples = first + (block - header * channels) * 8 // (width * channels)
    if len(fmt) >= 20 and int.from_bytes(fmt[16:18], "little") >= 2:
        samples = max(samples, int.from_bytes(fmt[18:20], "little"))
    return block, samples


def _wav(data: bytes) -> float | None:
    at, rate, per_block = 12, 0, None
    while at + 8 <= len(data):
        name, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        if name == b"fmt " and size >= 16:
            fmt = data[at + 8 : at + 8 + size]
            tag, _, rate = struct.unpack_from("<HHI", fmt)
            if tag == _WAV_EXTENSIBLE:
                # WAVE_FORMAT_EXTENSIBLE: the codec is the SubFormat GUID's first field.
                tag = int.from_bytes(fmt[24:26], "little") if len(fmt) >= 40 else 0
            per_block = _wav_samples_per_block(tag, fmt)
        elif name == b"data":
            if not rate or per_block is None:
                return None
            block, samples = per_block
            held = len(data) - at - 8
            return -(-held // block) * samples / rate
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
