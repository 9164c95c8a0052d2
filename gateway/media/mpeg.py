"""MPEG audio framing, as FFmpeg's mp3 probe and demuxer read it: the ID3v2 tag it skips
first, and frame headers (each says its own length)."""

from __future__ import annotations

# MPEG audio frame headers: bit rates (kbit/s) by (MPEG-1, layer bits), sample rates by
# version bits (0: MPEG-2.5, 2: MPEG-2, 3: MPEG-1).
_KBPS: dict[tuple[bool, int], tuple[int, ...]] = {
    (True, 3): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 1): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 3): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 1): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
SAME_STREAM = 0xFFFE0C00  # sync, version, layer and sample rate agree between frames


def id3_length(data: bytes) -> int:
    """The length of the ID3v2 tag at the start of `data` (0 without one), which FFmpeg
    skips before it probes the format; -1 for an `ID3` start that is not a tag."""
    if data[:3] != b"ID3":
        return 0
    if len(data) < 10 or 0xFF in data[3:5] or any(b & 0x80 for b in data[6:10]):
        return -1
    size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]
    return 10 + size + (10 if data[5] & 0x10 else 0)


def mpeg_frame(data: bytes, at: int) -> tuple[int, int] | None:
    """(header, length) of the MPEG audio frame whose header is at `at`, or None. A
    free-format frame (no bit rate, so no length) counts as invalid."""
    if at < 0 or at + 4 > len(data):
        return None
    header = int.from_bytes(data[at : at + 4], "big")
    version, layer = (header >> 19) & 3, (header >> 17) & 3
    rate_index, sample_index = (header >> 12) & 15, (header >> 10) & 3
    if header & 0xFFE00000 != 0xFFE00000 or version == 1 or layer == 0:
        return None
    if rate_index in (0, 15) or sample_index == 3:
        return None
    bits = _KBPS[(version == 3, layer)][rate_index] * 1000
    rate, padding = RATES[version][sample_index], (header >> 9) & 1
    if layer == 3:  # layer I: 4-byte slots
        return header, (12 * bits // rate + padding) * 4
    per_frame = 72 if layer == 1 and version != 3 else 144  # layer III outside MPEG-1
    return header, per_frame * bits // rate + padding
