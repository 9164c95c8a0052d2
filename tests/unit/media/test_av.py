"""Audio and video containers as tables: real files written by FFmpeg's muxers and by
Python's `wave` are accepted; a magic prefix followed by anything else is refused with
`media_invalid`, in particular FFmpeg's text formats that open other URLs (an HLS
playlist after an ID3 tag is probed as HLS: FFmpeg skips the tag)."""

from __future__ import annotations

import io
import random
import struct
import wave

import pytest

from bench.harness.samples import MP4, WEBM, wav
from gateway.errors import MediaInvalid
from gateway.media.av import validate_audio, validate_video
from gateway.media.settings import MediaSettings
from gateway.media.types import AUDIO_TYPES, VIDEO_TYPES
from tests.unit.media.test_samples import av_sample

SETTINGS = MediaSettings(
    audio_formats=list(AUDIO_TYPES),
    video_formats=list(VIDEO_TYPES),
    max_bytes=1_000_000,
    allow_unknown_duration=True,  # the container checks, whether or not a file is timed
)

CANARY = b"http://127.0.0.1:9/seg.ts"
HLS = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n" + CANARY + b"\n#EXT-X-ENDLIST\n"
MPD = (
    b'<?xml version="1.0"?><MPD profiles="urn:mpeg:dash:profile:isoff-live:2011">'
    b"<BaseURL>http://127.0.0.1:9/</BaseURL></MPD>\n"
)
SDP = b"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 127.0.0.1\r\nm=audio 9 RTP/AVP 0\r\n"
CONCAT = b"ffconcat version 1.0\nfile http://127.0.0.1:9/a.wav\n"
ID3 = b"ID3\x04\x00\x00\x00\x00\x00\x00"  # an empty ID3v2.4 tag: 10 bytes
FRAME = b"\xff\xfb\x90\x64"  # MPEG-1 layer III, 128 kbit/s, 44.1 kHz: 417 bytes a frame
FRAME_BYTES = 417


def frames(*payloads: bytes) -> bytes:
    """MPEG audio frames, each header followed by `payload` padded to the frame length."""
    return b"".join(FRAME + p.ljust(FRAME_BYTES - 4, b" ") for p in payloads)


def wave_file(channels: int, width: int, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(bytes(channels * width * 1600))
    return out.getvalue()


def riff(*chunks: tuple[bytes, bytes]) -> bytes:
    body = b"WAVE" + b"".join(n + struct.pack("<I", len(d)) + d for n, d in chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


FMT = struct.pack("<HHIIHH", 1, 1, 8000, 16000, 2, 16)
FLAC = av_sample("tone.flac")
OGG = av_sample("tone.ogg")
M4A = av_sample("tone.m4a")
REAL_MP3 = av_sample("tone.mp3")

GOOD_AUDIO = [
    ("tone.mp3", "audio/mpeg"),  # ID3v2.4 tag, then an MPEG-2 layer III Info frame
    ("tone-no-id3.mp3", "audio/mpeg"),
    ("tone-44k-stereo.mp3", "audio/mp3"),
    ("tone.wav", "audio/wav"),  # fmt, then LIST, then data
    ("tone.flac", "audio/flac"),
    ("tone.ogg", "audio/ogg"),  # Vorbis
    ("tone.opus", "audio/ogg"),
    ("tone.m4a", "audio/mp4"),
    ("tone.weba", "audio/webm"),
]
GOOD_VIDEO = [
    ("clip.mp4", "video/mp4"),
    ("clip.webm", "video/webm"),
    ("clip.mkv", "video/x-matroska"),
    ("clip.mov", "video/quicktime"),
]


@pytest.mark.parametrize(("name", "declared"), GOOD_AUDIO, ids=[g[0] for g in GOOD_AUDIO])
def test_real_audio_files_are_accepted(name: str, declared: str) -> None:
    data = av_sample(name)
    assert validate_audio(data, declared, SETTINGS).data == data


@pytest.mark.parametrize(("name", "declared"), GOOD_VIDEO, ids=[g[0] for g in GOOD_VIDEO])
def test_real_video_files_are_accepted(name: str, declared: str) -> None:
    data = av_sample(name)
    assert validate_video(data, declared, SETTINGS).data == data


@pytest.mark.parametrize(
    ("channels", "width", "rate"), [(1, 1, 8000), (1, 2, 16000), (2, 2, 44100), (2, 4, 48000)]
)
def test_wave_module_files_are_accepted(channels: int, width: int, rate: int) -> None:
    data = wave_file(channels, width, rate)
    assert validate_audio(data, "audio/wav", SETTINGS).data == data


def test_built_samples_are_accepted() -> None:
    """The bench's in-memory samples carry the structures the checks read."""
    assert validate_audio(wav(), "audio/wav", SETTINGS).data == wav()
    assert validate_video(MP4, "video/mp4", SETTINGS).data == MP4
    assert validate_video(WEBM, "video/webm", SETTINGS).data == WEBM


def test_an_mp3_may_end_after_one_frame_or_with_an_id3v1_tag() -> None:
    one = ID3 + frames(b"")
    tagged = ID3 + frames(b"", b"") + b"TAG" + bytes(125)
    for data in (one, tagged):
        assert validate_audio(data, "audio/mpeg", SETTINGS).data == data


BAD_AUDIO = [
    # mp3: FFmpeg skips an ID3v2 tag and probes what follows.
    ("id3 + hls playlist", ID3 + HLS, "audio/mpeg"),
    ("id3 + garbage", ID3 + bytes(range(1, 200)), "audio/mpeg"),
    ("id3 alone", ID3, "audio/mpeg"),
    ("id3 + dash manifest", ID3 + MPD, "audio/mpeg"),
    ("id3 + sdp", ID3 + SDP, "audio/mpeg"),
    ("id3 + ffconcat", ID3 + CONCAT, "audio/mpeg"),
    ("id3 with a footer flag, frame where the footer is", b"ID3\x04\x00\x10\x00\x00\x00\x00"
     + frames(b"", b""), "audio/mpeg"),
    ("id3 size not syncsafe", b"ID3\x04\x00\x00\x00\x00\x00\x80" + frames(b"", b""),
     "audio/mpeg"),
    ("id3 + frame + hls where the second frame should be", ID3 + frames(b"") + HLS,
     "audio/mpeg"),
    ("id3 + frames holding an hls playlist", ID3 + frames(b"\n" + HLS, b""), "audio/mpeg"),
    ("id3 + frames holding a dash manifest", ID3 + frames(MPD, b""), "audio/mpeg"),
    ("frame sync + hls", FRAME + b"\n" + HLS, "audio/mpeg"),
    ("frame sync + sdp", frames(b"\r\n" + SDP, b""), "audio/mpeg"),
    ("free-format frame", ID3 + b"\xff\xfb\x00\x64" + bytes(800), "audio/mpeg"),
    ("reserved mpeg version", ID3 + b"\xff\xeb\x90\x64" + bytes(800), "audio/mpeg"),
    ("second frame of another stream", ID3 + FRAME + bytes(413) + b"\xff\xf3\x58\xc0"
     + bytes(200), "audio/mpeg"),
    ("real mp3 with its tag grown over the first frame", REAL_MP3[:9] + b"\x24"
     + REAL_MP3[10:], "audio/mpeg"),
    # wav
    ("riff wave + hls", b"RIFF\x24\x00\x00\x00WAVE" + HLS, "audio/wav"),
    ("riff wave + dash, no NUL byte", b"RIFF\x41\x41\x41\x41WAVE" + MPD, "audio/wav"),
    ("riff wave alone", b"RIFF0000WAVE", "audio/wav"),
    ("data before fmt", riff((b"data", bytes(64)), (b"fmt ", FMT)), "audio/wav"),
    ("fmt too short", riff((b"fmt ", FMT[:12]), (b"data", bytes(64))), "audio/wav"),
    ("no channels", riff((b"fmt ", struct.pack("<HHIIHH", 1, 0, 8000, 16000, 2, 16)),
                         (b"data", bytes(64))), "audio/wav"),
    ("chunk larger than the file", riff((b"LIST", bytes(8))).replace(b"\x08\x00\x00\x00",
     b"\xff\xff\x00\x00") + FMT, "audio/wav"),
    # flac
    ("flac + hls", b"fLaC" + HLS, "audio/flac"),
    ("flac zeros", b"fLaC" + bytes(40), "audio/flac"),
    ("flac streaminfo then a playlist", FLAC[:42] + b"\x04" + HLS, "audio/flac"),
    ("flac metadata then no frame", FLAC[:FLAC.index(b"\xff\xf8")] + HLS, "audio/flac"),
    # ogg
    ("oggs + hls", b"OggS" + HLS, "audio/ogg"),
    ("ogg zeros", b"OggS" + bytes(40), "audio/ogg"),
    ("ogg version 1", OGG[:4] + b"\x01" + OGG[5:], "audio/ogg"),
    ("ogg first page not beginning a stream", OGG[:5] + b"\x00" + OGG[6:], "audio/ogg"),
    ("ogg page cut short", OGG[:40], "audio/ogg"),
    ("ogg page then a playlist", OGG[:OGG.index(b"OggS", 4)] + HLS, "audio/ogg"),
    # m4a (ISO base media)
    ("ftyp + hls", M4A[:28] + HLS, "audio/mp4"),
]  # fmt: skip

BAD_VIDEO = [
    ("ftyp + hls", b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + HLS, "video/mp4"),
    ("ftyp only", MP4[:24], "video/mp4"),
    ("ftyp of absurd size", b"\x00\x10\x00\x00" + MP4[4:], "video/mp4"),
    ("ftyp with half a brand", b"\x00\x00\x00\x16" + MP4[4:22] + MP4[24:], "video/mp4"),
    ("box larger than the file", MP4[:24] + b"\x7f\x00\x00\x00mdat" + bytes(64), "video/mp4"),
    ("box with a 64-bit size past the end", MP4[:24] + b"\x00\x00\x00\x01mdat"
     + struct.pack(">Q", 1 << 40) + bytes(64), "video/mp4"),
    ("ebml + hls", b"\x1a\x45\xdf\xa3" + HLS, "video/webm"),
    ("ebml zeros", b"\x1a\x45\xdf\xa3" + bytes(64), "video/webm"),
    ("ebml of another doctype", WEBM.replace(b"\x84webm", b"\x84html"), "video/webm"),
    ("ebml header without a segment", WEBM[:36] + HLS, "video/webm"),
    ("ebml header over 1 KiB", b"\x1a\x45\xdf\xa3" + (0x10000000 | 4096 + 31).to_bytes(4, "big")
     + b"\xec\x80" * 2048 + WEBM[5:], "video/webm"),  # 2,048 empty Void elements
    ("ebml + segment holding a dash manifest", WEBM[:44] + MPD, "video/webm"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "data", "declared"), BAD_AUDIO, ids=[b[0] for b in BAD_AUDIO])
def test_audio_that_is_not_its_container_is_refused(label: str, data: bytes, declared: str) -> None:
    with pytest.raises(MediaInvalid) as caught:
        validate_audio(data, declared, SETTINGS)
    assert caught.value.code == "media_invalid"


@pytest.mark.parametrize(("label", "data", "declared"), BAD_VIDEO, ids=[b[0] for b in BAD_VIDEO])
def test_video_that_is_not_its_container_is_refused(label: str, data: bytes, declared: str) -> None:
    with pytest.raises(MediaInvalid) as caught:
        validate_video(data, declared, SETTINGS)
    assert caught.value.code == "media_invalid"


def id3_tag(size: int, header: bytes = b"ID3\x04\x00\x00") -> bytes:
    """An ID3v2 header (`header`: magic, version, revision, flags) for `size` bytes."""
    return header + bytes((size >> shift) & 0x7F for shift in (21, 14, 7, 0))


# FFmpeg skips an ID3v2 tag only when it fits in its 1 MiB probe buffer: a larger one is
# probed from byte 0, and SDP's probe steps over NUL bytes inside a line.
BIG_TAG = 0x204081  # 2,113,665 bytes
RTP_SDP = b"\nv=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\nm=audio 9 RTP/AVP 0\n"
LARGE = MediaSettings(audio_formats=list(AUDIO_TYPES), max_bytes=4_000_000)
PROBED_SDP = [
    (
        "an sdp description inside an id3 tag over 1 MiB, header without a nul",
        id3_tag(BIG_TAG, b"ID3\x04\x01\x01")
        + RTP_SDP
        + bytes(BIG_TAG - len(RTP_SDP))
        + (FRAME + bytes(413)) * 3,
    ),
    (
        "the same with crlf lines",
        id3_tag(BIG_TAG, b"ID3\x04\x01\x01")
        + RTP_SDP.replace(b"\n", b"\r\n")
        + bytes(BIG_TAG - len(RTP_SDP.replace(b"\n", b"\r\n")))
        + (FRAME + bytes(413)) * 3,
    ),
    ("sdp lines after nul bytes inside a line", (FRAME + bytes(413)) * 2 + RTP_SDP),
]


@pytest.mark.parametrize(("label", "data"), PROBED_SDP, ids=[p[0] for p in PROBED_SDP])
def test_sdp_where_ffmpeg_probes_it_is_refused(label: str, data: bytes) -> None:
    with pytest.raises(MediaInvalid) as caught:
        validate_audio(data, "audio/mpeg", LARGE)
    assert caught.value.code == "media_invalid"


def test_an_mp3_with_an_id3_tag_over_1_mib_is_accepted() -> None:
    """Cover art can make a real tag larger than FFmpeg's probe buffer: its bytes are
    not text FFmpeg reads."""
    art = random.Random(7).randbytes(BIG_TAG)
    data = id3_tag(BIG_TAG) + art + (FRAME + bytes(413)) * 3
    assert validate_audio(data, "audio/mpeg", LARGE).data == data
