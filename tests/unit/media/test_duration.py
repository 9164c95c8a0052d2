"""How long audio plays, read from its headers (gateway/media/duration.py), as a table:
WAV counts the samples its codec puts in the bytes held (an IMA-ADPCM block of 256
bytes is 505 samples, not one), and a file whose duration the headers do not give is
refused unless `media.allow_unknown_duration`."""

from __future__ import annotations

import struct

import pytest

from gateway.errors import MediaDurationUnknown, MediaTooLarge
from gateway.media.av import validate_audio, validate_video
from gateway.media.duration import duration
from gateway.media.settings import MediaSettings
from gateway.media.types import AUDIO_TYPES, VIDEO_TYPES
from tests.unit.media.test_samples import av_sample

STRICT = MediaSettings(
    audio_formats=list(AUDIO_TYPES), video_formats=list(VIDEO_TYPES), max_audio_seconds=600
)
LAX = STRICT.model_copy(update={"allow_unknown_duration": True})


def riff_wav(fmt: bytes, data: bytes, *extra: bytes) -> bytes:
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data + b"".join(extra)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def fmt(tag: int, channels: int, rate: int, block: int, bits: int, ext: bytes = b"") -> bytes:
    base = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    return base + (struct.pack("<H", len(ext)) + ext if ext else b"")


def ima(channels: int, block: int, per_block: int) -> bytes:
    return fmt(0x11, channels, 8000, block, 4, struct.pack("<H", per_block))


# 5 MiB of IMA ADPCM at 8 kHz in 256-byte blocks: read 2.6 s counted in blocks.
IMA_5MIB = riff_wav(ima(1, 256, 505), bytes(5 * 1024 * 1024))
EXTENSIBLE_PCM = fmt(0xFFFE, 1, 8000, 2, 16, struct.pack("<HI", 16, 4) + b"\x01\x00" + bytes(14))

SECONDS = [
    # 20,480 blocks of 505 samples at 8 kHz.
    ("ima adpcm, 5 MiB", IMA_5MIB, 20480 * 505 / 8000),
    # A header naming fewer samples than the block holds: the decoder's count wins.
    ("ima, samples per block small", riff_wav(ima(1, 256, 2), bytes(2560)), 10 * 505 / 8000),
    # ...and more: the header's count (libsndfile reads it).
    ("ima, samples per block large", riff_wav(ima(1, 256, 4000), bytes(2560)), 10 * 4000 / 8000),
    ("ima adpcm stereo", riff_wav(ima(2, 512, 505), bytes(5120)), 10 * 505 / 8000),
    ("ms adpcm", riff_wav(fmt(0x02, 1, 8000, 256, 4), bytes(2560)), 10 * 500 / 8000),
    ("pcm 16-bit", riff_wav(fmt(1, 1, 8000, 2, 16), bytes(16000)), 1.0),
    # A block size claiming 64 KiB frames: the samples' width (1 byte) is what is read.
    ("pcm, block size too large", riff_wav(fmt(1, 1, 8000, 65535, 8), bytes(8000)), 1.0),
    ("extensible pcm", riff_wav(EXTENSIBLE_PCM, bytes(16000)), 1.0),
    ("mu-law", riff_wav(fmt(7, 1, 8000, 1, 8), bytes(8000)), 1.0),
    # A `data` chunk whose size says 2 bytes, followed by more: FFmpeg reads on.
    ("data chunk size too small", riff_wav(fmt(1, 1, 8000, 1, 8), bytes(2), bytes(7998)), 1.0),
]


@pytest.mark.parametrize(("name", "data", "seconds"), SECONDS, ids=[c[0] for c in SECONDS])
def test_wav_counts_the_samples_its_codec_holds(name: str, data: bytes, seconds: float) -> None:
    assert duration("wav", data) == pytest.approx(seconds, rel=1e-3)


def test_a_5_mib_ima_adpcm_wav_is_held_to_the_cap() -> None:
    with pytest.raises(MediaTooLarge):
        validate_audio(IMA_5MIB, "audio/wav", STRICT.model_copy(update={"max_bytes": 8 << 20}))


UNKNOWN = [
    ("mp3 in wav", riff_wav(fmt(0x55, 1, 8000, 1, 0), bytes(4000)), "audio/wav"),
    ("gsm in wav", riff_wav(fmt(0x31, 1, 8000, 65, 0), bytes(6500)), "audio/wav"),
    ("ogg vorbis", av_sample("tone.ogg"), "audio/ogg"),
    ("ogg opus", av_sample("tone.opus"), "audio/ogg"),
]


@pytest.mark.parametrize(("name", "data", "declared"), UNKNOWN, ids=[c[0] for c in UNKNOWN])
def test_audio_of_unknown_duration_is_refused_unless_allowed(
    name: str, data: bytes, declared: str
) -> None:
    with pytest.raises(MediaDurationUnknown):
        validate_audio(data, declared, STRICT)
    assert validate_audio(data, declared, LAX).seconds is None


def test_flac_without_its_sample_count_is_unknown() -> None:
    flac = av_sample("tone.flac")
    assert duration("flac", flac) == pytest.approx(0.3, abs=0.05)
    # STREAMINFO's 36-bit total samples (the low 4 bits of byte 21, then 22..25): 0.
    zeroed = flac[:21] + bytes([flac[21] & 0xF0]) + bytes(4) + flac[26:]
    assert duration("flac", zeroed) is None
    with pytest.raises(MediaDurationUnknown):
        validate_audio(zeroed, "audio/flac", STRICT)


def test_webm_and_mkv_are_unknown() -> None:
    for name, declared in (("clip.webm", "video/webm"), ("clip.mkv", "video/x-matroska")):
        with pytest.raises(MediaDurationUnknown):
            validate_video(av_sample(name), declared, STRICT)
        assert validate_video(av_sample(name), declared, LAX).seconds is None


def test_timed_files_carry_their_seconds() -> None:
    assert validate_audio(av_sample("tone.wav"), "audio/wav", STRICT).seconds == pytest.approx(
        duration("wav", av_sample("tone.wav"))
    )
    assert validate_video(av_sample("clip.mp4"), "video/mp4", STRICT).seconds is not None
