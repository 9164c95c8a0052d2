"""A check that each sample medium (bench/harness/samples.py, shared with the bench) is what its
name says; some tests import the samples through here."""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path

from PIL import Image

from bench.harness.samples import HTML, SVG, data_url, gif, jpeg, png, wav
from gateway.media.av import sniff

# What the payload, multipart and real-engine tests import from here.
__all__ = ["HTML", "SVG", "av_sample", "data_url", "jpeg", "media_digest", "png", "wav"]

# Audio and video written by FFmpeg's own muxers (tests/data/media/make_samples.py).
AV_SAMPLES = Path(__file__).resolve().parents[2] / "data" / "media"


def av_sample(name: str) -> bytes:
    return (AV_SAMPLES / name).read_bytes()


def media_digest(data: bytes) -> str:
    """The digest routing knows inline media by: the sha256 of its canonical base64."""
    return hashlib.sha256(base64.b64encode(data)).hexdigest()


def test_samples_are_what_they_claim() -> None:
    assert Image.open(io.BytesIO(png())).format == "PNG"
    assert Image.open(io.BytesIO(jpeg())).format == "JPEG"
    with Image.open(io.BytesIO(gif(5))) as image:
        assert image.n_frames == 5
    assert wav()[:4] == b"RIFF" and wav()[8:12] == b"WAVE"


def test_av_samples_are_the_containers_their_names_say() -> None:
    names = {
        "tone.mp3": "mp3", "tone-no-id3.mp3": "mp3", "tone-44k-stereo.mp3": "mp3",
        "tone.wav": "wav", "tone.flac": "flac", "tone.ogg": "ogg", "tone.opus": "ogg",
        "tone.m4a": "m4a", "tone.weba": "webm", "clip.mp4": "mp4", "clip.webm": "webm",
        "clip.mkv": "webm", "clip.mov": "mov",
    }  # fmt: skip
    assert names.keys() == {p.name for p in AV_SAMPLES.iterdir() if p.suffix != ".py"}
    assert {name: sniff(av_sample(name)) for name in names} == names
    assert av_sample("tone.mp3")[:3] == b"ID3" and av_sample("tone-no-id3.mp3")[:3] != b"ID3"
