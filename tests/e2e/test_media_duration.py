"""Audio and video that play longer than `media.max_audio_seconds` /
`media.max_video_seconds` (read from the container's headers) are refused with 413
`media_too_large` before the engine sees them; shorter ones are forwarded. Items whose
headers do not say how long they play (Ogg, WebM, a FLAC without its sample count, a WAV
codec the gateway does not count) are refused with 413 `media_duration_unknown`. Through
the gateway under uvicorn, a simulated engine that records what it receives, and a
loopback media origin."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bench.harness.metrics import HTTP
from bench.harness.samples import data_url
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    RecordingServer,
    Route,
    auth,
    error_code,
    gateway_proc,
    running,
    sim_proc,
    wait_for,
)
from tests.unit.media.test_samples import av_sample

KEY = "key-duration-0123456789abcdef"
LIMIT = 5  # seconds, audio and video alike


def wav(frames: int, rate: int) -> bytes:
    """8-bit mono PCM: `frames` samples at `rate` Hz (a 1 Hz rate: a second a byte)."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
    body += b"data" + struct.pack("<I", frames) + bytes(frames)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def ima_adpcm(blocks: int) -> bytes:
    """Mono IMA ADPCM at 8 kHz in 256-byte blocks: 505 samples (63 ms) a block, which a
    count of blocks read as 1/8000 s."""
    fmt = struct.pack("<HHIIHHHH", 0x11, 1, 8000, 4055, 256, 4, 2, 505)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", 256 * blocks) + bytes(256 * blocks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def flac_without_length() -> bytes:
    """A real FLAC whose STREAMINFO says 0 total samples (unknown)."""
    flac = av_sample("tone.flac")
    return flac[:21] + bytes([flac[21] & 0xF0]) + bytes(4) + flac[26:]


def mp3(frames: int) -> bytes:
    """MPEG-2.5 layer III at 8 kbit/s and 8 kHz: 72 bytes and 72 ms a frame."""
    return (b"\xff\xe3\x18\x00" + bytes(68)) * frames


def mp4(seconds: int) -> bytes:
    """`ftyp`, a `moov` whose `mvhd` declares `seconds` (time scale 1000), an `mdat`."""
    mvhd_body = bytes(4) + struct.pack(">IIII", 0, 0, 1000, seconds * 1000) + bytes(80)
    mvhd = struct.pack(">I", 8 + len(mvhd_body)) + b"mvhd" + mvhd_body
    moov = struct.pack(">I", 8 + len(mvhd)) + b"moov" + mvhd
    ftyp = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"
    return ftyp + moov + struct.pack(">I", 72) + b"mdat" + bytes(64)


@dataclass
class Stack:
    sim: Proc
    gateway: Proc
    origin: RecordingServer

    def ask(self, part: dict[str, Any]) -> Any:
        content = [part, {"type": "text", "text": "What is it?"}]
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
        return HTTP.post(
            self.gateway.url + "/v1/chat/completions", json=body, headers=auth(KEY), timeout=20
        )

    def upload(self, name: str, data: bytes, mime: str) -> Any:
        return HTTP.post(
            self.gateway.url + "/v1/audio/transcriptions",
            headers=auth(KEY),
            files={"file": (name, data, mime)},
            data={"model": MODEL},
            timeout=20,
        )

    def engine_posts(self) -> int:
        got = HTTP.get(self.sim.url + "/sim/requests").json()
        return sum(1 for r in got if r["method"] == "POST")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("media-duration")
    routes = {
        "/long.mp3": Route(body=mp3(100), headers={"Content-Type": "audio/mpeg"}),
        "/short.mp3": Route(body=mp3(20), headers={"Content-Type": "audio/mpeg"}),
        "/tone.ogg": Route(body=av_sample("tone.ogg"), headers={"Content-Type": "audio/ogg"}),
        "/adpcm.wav": Route(body=ima_adpcm(100), headers={"Content-Type": "audio/wav"}),
    }
    sim = sim_proc(tmp, "--record-requests", "50", "--latency", "zero")
    with RecordingServer(routes) as origin, running(sim):
        env = {
            "GATEWAY_ENGINES": json.dumps([sim.url]),
            "GATEWAY_API_KEYS": json.dumps([KEY]),
            "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps([f"127.0.0.1:{origin.port}"]),
            "GATEWAY_MEDIA__ALLOWED_SCHEMES": json.dumps(["http"]),
            "GATEWAY_MEDIA__ALLOWED_NETWORKS": json.dumps(["127.0.0.0/8"]),
            "GATEWAY_MEDIA__MAX_AUDIO_SECONDS": str(LIMIT),
            "GATEWAY_MEDIA__MAX_VIDEO_SECONDS": str(LIMIT),
        }
        gateway = gateway_proc(tmp, env)
        with running(gateway, ready_path="/healthz"):
            assert wait_for(lambda: HTTP.get(gateway.url + "/readyz").status_code == 200)
            yield Stack(sim, gateway, origin)


def input_audio(data: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(),
                                                   "format": fmt}}  # fmt: skip


def audio_url(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def video_url(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


LONG = {
    # 2,000 bytes at a 1 Hz sample rate: 33 minutes for the engine to resample.
    "wav at 1 Hz": lambda o: input_audio(wav(2000, 1), "wav"),
    "wav data url": lambda o: audio_url(data_url("audio/wav", wav(8000 * 6, 8000))),
    "mp3 fetched": lambda o: audio_url(f"http://127.0.0.1:{o.port}/long.mp3"),
    "mp3 inline": lambda o: input_audio(mp3(100), "mp3"),
    "mp4 declared an hour": lambda o: video_url(data_url("video/mp4", mp4(3600))),
    # 100 blocks: 6.3 s (read as 0.0125 s when blocks were counted as samples).
    "ima adpcm wav inline": lambda o: input_audio(ima_adpcm(100), "wav"),
    "ima adpcm wav data url": lambda o: audio_url(data_url("audio/wav", ima_adpcm(100))),
    "ima adpcm wav fetched": lambda o: audio_url(f"http://127.0.0.1:{o.port}/adpcm.wav"),
}
UNKNOWN = {
    "ogg inline": lambda o: input_audio(av_sample("tone.ogg"), "ogg"),
    "ogg fetched": lambda o: audio_url(f"http://127.0.0.1:{o.port}/tone.ogg"),
    "opus data url": lambda o: audio_url(data_url("audio/ogg", av_sample("tone.opus"))),
    "flac without its length": lambda o: input_audio(flac_without_length(), "flac"),
    "webm": lambda o: video_url(data_url("video/webm", av_sample("clip.webm"))),
}
SHORT = {
    "wav": lambda o: input_audio(wav(8000 * 4, 8000), "wav"),
    "ima adpcm wav": lambda o: input_audio(ima_adpcm(60), "wav"),  # 3.8 s
    "flac": lambda o: input_audio(av_sample("tone.flac"), "flac"),
    "mp3 fetched": lambda o: audio_url(f"http://127.0.0.1:{o.port}/short.mp3"),
    "mp4": lambda o: video_url(data_url("video/mp4", mp4(4))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LONG))
def test_media_longer_than_the_limit_is_refused_before_the_engine(stack: Stack, name: str) -> None:
    before = stack.engine_posts()
    r = stack.ask(LONG[name](stack.origin))
    assert (r.status_code, error_code(r)) == (413, "media_too_large"), r.text
    assert stack.engine_posts() == before


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHORT))
def test_media_within_the_limit_is_forwarded(stack: Stack, name: str) -> None:
    before = stack.engine_posts()
    r = stack.ask(SHORT[name](stack.origin))
    assert error_code(r) is None, r.text
    assert stack.engine_posts() == before + 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNKNOWN))
def test_media_of_unknown_duration_is_refused_before_the_engine(stack: Stack, name: str) -> None:
    before = stack.engine_posts()
    r = stack.ask(UNKNOWN[name](stack.origin))
    assert (r.status_code, error_code(r)) == (413, "media_duration_unknown"), r.text
    assert stack.engine_posts() == before


UPLOADS = {
    "ima adpcm wav, 6.3 s": (ima_adpcm(100), "audio/wav", "media_too_large"),
    "wav at 1 Hz": (wav(2000, 1), "application/octet-stream", "media_too_large"),
    "ogg": (av_sample("tone.ogg"), "audio/ogg", "media_duration_unknown"),
    "flac without its length": (flac_without_length(), "audio/flac", "media_duration_unknown"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UPLOADS))
def test_uploads_too_long_or_untimed_are_refused_before_the_engine(stack: Stack, name: str) -> None:
    data, mime, code = UPLOADS[name]
    before = stack.engine_posts()
    r = stack.upload("a.bin", data, mime)
    assert (r.status_code, error_code(r)) == (413, code), r.text
    assert stack.engine_posts() == before


@pytest.mark.slow
def test_a_short_adpcm_upload_is_forwarded(stack: Stack) -> None:
    before = stack.engine_posts()
    r = stack.upload("a.wav", ima_adpcm(60), "audio/wav")
    assert error_code(r) is None, r.text
    assert stack.engine_posts() == before + 1
