"""A check that each sample medium (bench/samples.py, shared with the bench) is what its
name says; some tests import the samples through here."""

from __future__ import annotations

import base64
import hashlib
import io

from PIL import Image

from bench.samples import HTML, SVG, data_url, gif, jpeg, png, wav

# What the payload, multipart and real-engine tests import from here.
__all__ = ["HTML", "SVG", "data_url", "jpeg", "media_digest", "png", "wav"]


def media_digest(data: bytes) -> str:
    """The digest routing knows inline media by: the sha256 of its canonical base64."""
    return hashlib.sha256(base64.b64encode(data)).hexdigest()


def test_samples_are_what_they_claim() -> None:
    assert Image.open(io.BytesIO(png())).format == "PNG"
    assert Image.open(io.BytesIO(jpeg())).format == "JPEG"
    with Image.open(io.BytesIO(gif(5))) as image:
        assert image.n_frames == 5
    assert wav()[:4] == b"RIFF" and wav()[8:12] == b"WAVE"
