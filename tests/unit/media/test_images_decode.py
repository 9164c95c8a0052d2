"""Reduced decoding and what decodes are charged (gateway/media/images.py), as tables:
a JPEG decoded at 1/8 scale gets the verdict a full decode gets; `reencode` still
produces the whole image; the charge of each kind of image at each depth."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
from PIL import Image

from bench.harness.samples import encode, gif, png
from gateway.errors import MediaInvalid
from gateway.media.images import (
    ImageHeader,
    decode_cost,
    decode_image,
    read_header,
)
from gateway.media.settings import MediaSettings
from gateway.media.types import ValidationDepth
from tests.unit.media.image_validation import validate_image

SIDE = 800
DECODE = MediaSettings()
REENCODE = MediaSettings(validation=ValidationDepth.reencode)


def _noise(side: int = SIDE) -> Image.Image:
    return Image.effect_noise((side, side), 80).convert("RGB")


def _jpeg(progressive: bool) -> bytes:
    out = io.BytesIO()
    _noise().save(out, "JPEG", quality=90, progressive=progressive)
    return out.getvalue()


def _cut(fraction: float) -> Callable[[bytes], bytes]:
    return lambda data: data[: int(len(data) * fraction)]


def _overwrite(fraction: float, chunk: bytes) -> Callable[[bytes], bytes]:
    def damage(data: bytes) -> bytes:
        out = bytearray(data)
        i = int(len(data) * fraction)
        out[i : i + len(chunk)] = chunk
        return bytes(out)

    return damage


def _full_decode_passes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception:
        return False
    return True


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize(
    ("damage", "passes"),
    [
        (lambda d: d, True),
        (_cut(0.3), False),
        (_cut(0.9), False),
        (_cut(0.99), False),
        # A marker in the middle of the scan.
        (_overwrite(0.3, b"\xff\xc4"), False),
        (_overwrite(0.6, b"\xff\xc4"), False),
        # Zeroed or EOI-filled scan data: libjpeg decodes it (wrong pixels, no error) at
        # any scale; no depth short of comparing pixels can tell.
        (_overwrite(0.3, bytes(200)), True),
        (_overwrite(0.6, b"\xff\xd9" * 25), True),
    ],
)
def test_a_jpeg_decoded_at_reduced_scale_gets_the_full_decodes_verdict(
    progressive: bool, damage: Callable[[bytes], bytes], passes: bool
) -> None:
    data = damage(_jpeg(progressive))
    assert _full_decode_passes(data) is passes
    if passes:
        assert validate_image(data, "image/jpeg", DECODE).data == data
    else:
        with pytest.raises(MediaInvalid):
            validate_image(data, "image/jpeg", DECODE)


@pytest.mark.parametrize(
    ("data", "declared"),
    [
        (_jpeg(False), "image/jpeg"),
        (_jpeg(True), "image/jpeg"),
        (encode(_noise().convert("RGBA"), "PNG"), "image/png"),
        (encode(_noise(), "WEBP"), "image/webp"),
    ],
)
def test_reencode_produces_the_whole_image(data: bytes, declared: str) -> None:
    info = validate_image(data, declared, REENCODE)
    with Image.open(io.BytesIO(data)) as original, Image.open(io.BytesIO(info.data)) as out:
        assert out.size == original.size == (SIDE, SIDE)
        assert out.mode == original.mode
        out.load()
        original.load()
        # The same picture (JPEG and lossy WebP round again: close, not equal).
        got, want = out.tobytes()[:30000], original.tobytes()[:30000]
        assert sum(abs(a - b) for a, b in zip(got, want, strict=True)) / len(want) < 12


def _header(fmt: str, side: int, frames: int = 1, progressive: bool = False) -> ImageHeader:
    return ImageHeader(fmt, "", side, side, frames, progressive, ())


M = 1000 * 1000


@pytest.mark.parametrize(
    ("header", "depth", "cost"),
    [
        (_header("PNG", 1000), ValidationDepth.header, 0),
        (_header("PNG", 1000), ValidationDepth.decode, 5 * M),
        (_header("PNG", 1000), ValidationDepth.reencode, 9 * M),
        (_header("GIF", 1000), ValidationDepth.decode, 5 * M),
        (_header("GIF", 1000, frames=3), ValidationDepth.decode, 14 * M),
        (_header("PNG", 1000, frames=2), ValidationDepth.decode, 14 * M),  # APNG
        (_header("WEBP", 1000), ValidationDepth.decode, 17 * M),
        (_header("WEBP", 1000), ValidationDepth.reencode, 21 * M),
        # JPEG at `decode`: 1/8 of each side.
        (_header("JPEG", 1000), ValidationDepth.decode, 5 * 125 * 125),
        (_header("JPEG", 1000), ValidationDepth.reencode, 9 * M),
        (_header("JPEG", 1000, progressive=True), ValidationDepth.decode, 5 * 125 * 125 + 6 * M),
        (_header("JPEG", 12), ValidationDepth.decode, 5 * 2 * 2),  # 12 / 8, rounded up
        (_header("JPEG", 5), ValidationDepth.decode, 5 * 2 * 2),  # 1/4 at most: 5 / 4
        (_header("JPEG", 1000, frames=2), ValidationDepth.decode, 14 * M),  # MPO: no draft
    ],
)
def test_decode_costs(header: ImageHeader, depth: ValidationDepth, cost: int) -> None:
    assert decode_cost(header, depth) == cost


@pytest.mark.parametrize(
    ("data", "declared", "pixels", "progressive"),
    [
        (png(30, 20), "image/png", 600, False),
        (gif(3, size=10), "image/gif", 300, False),  # every frame counts
        (_jpeg(True), "image/jpeg", SIDE * SIDE, True),
    ],
)
def test_the_header_says_what_a_decode_will_produce(
    data: bytes, declared: str, pixels: int, progressive: bool
) -> None:
    header = read_header(data, declared, DECODE)
    assert header.pixels == pixels
    assert header.progressive is progressive


def test_a_decode_refuses_a_frame_that_grows_the_image_past_its_header() -> None:
    # Pillow grows a GIF to a frame that reaches past it as it seeks there, and the
    # decode budget was charged for the header's size. gif_frames refuses such a file
    # from the header; the decode checks Pillow's own view of it as well, here with the
    # header the walk would not give (8 x 8, two frames).
    from tests.e2e.test_memory import gif_outgrowing_its_screen

    gif = gif_outgrowing_its_screen(512)
    header = ImageHeader("GIF", "image/gif", 8, 8, 2, False, ("GIF",))
    with pytest.raises(MediaInvalid, match="outside the image"):
        decode_image(gif, header, DECODE)
    # The same frames within the screen decode.
    fits = gif_outgrowing_its_screen(8)
    assert decode_image(fits, header, DECODE).frames == 2
