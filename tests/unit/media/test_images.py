"""Image, audio and video validation as tables: dangerous types, polyglots, bombs,
truncation, frame caps, declared types that lie."""

from __future__ import annotations

import base64
import io
import struct

import pytest
from PIL import Image

from bench.harness.samples import (
    EPS,
    HTML,
    MP4,
    SVG,
    WEBM,
    gif,
    jpeg,
    noisy_jpeg,
    png,
    png_chunk,
    png_header_only,
    wav,
)
from gateway.errors import GatewayError, MediaDurationUnknown, MediaInvalid, MediaTooLarge
from gateway.media.av import validate_audio, validate_video
from gateway.media.images import check_formats
from gateway.media.settings import MediaSettings
from gateway.media.types import ValidationDepth
from tests.unit.media.image_validation import validate_image, validate_jpeg_frames
from tests.unit.media.test_samples import av_sample

SETTINGS = MediaSettings(max_pixels=1_000_000, max_frames=8, max_bytes=200_000)


@pytest.mark.parametrize(
    ("data", "declared", "error"),
    [
        (SVG, "image/svg+xml", MediaInvalid),
        (SVG, "image/png", MediaInvalid),
        (HTML, "text/html", MediaInvalid),
        (HTML, "image/png", MediaInvalid),
        (EPS, "application/postscript", MediaInvalid),
        (EPS, "image/png", MediaInvalid),  # a polyglot label: PostScript bytes called PNG
        (b"%!PS-Adobe-3.0\n" + png(), "image/png", MediaInvalid),
        (png(), "image/jpeg", MediaInvalid),  # declared type must match the bytes
        (jpeg(), "image/png", MediaInvalid),
        (png(), None, MediaInvalid),
        (png(), "application/octet-stream", MediaInvalid),
        (b"", "image/png", MediaInvalid),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 30, "image/png", MediaInvalid),
        (png(1, 1, (0, 0, 0)).replace(b"IHDR", b"IHDX"), "image/png", MediaInvalid),
        (png()[:12], "image/png", MediaInvalid),  # cut inside the header
        (png_header_only(2000, 2000), "image/png", MediaTooLarge),  # over max_pixels
        (png_header_only(100_000, 100_000), "image/png", MediaTooLarge),  # Pillow's bomb
        (png_header_only(20_000, 20_000), "image/png", MediaTooLarge),
        (gif(12), "image/gif", MediaTooLarge),  # more frames than max_frames
        (b"x" * 200_001, "image/png", MediaTooLarge),
        (b"BM" + b"\x00" * 60, "image/bmp", MediaInvalid),  # BMP is not in the default list
    ],
)
@pytest.mark.parametrize("depth", list(ValidationDepth))
def test_bad_images_are_refused(
    data: bytes, declared: str | None, error: type[GatewayError], depth: ValidationDepth
) -> None:
    settings = SETTINGS.model_copy(update={"validation": depth})
    with pytest.raises(error) as info:
        validate_image(data, declared, settings)
    assert info.value.code in ("media_invalid", "media_too_large")
    assert info.value.status == (400 if error is MediaInvalid else 413)
    # Pillow's text never reaches the client.
    assert "PIL" not in info.value.message and "0x" not in info.value.message


@pytest.mark.parametrize(
    ("data", "declared", "fmt"),
    [
        (png(), "image/png", "PNG"),
        (png(), "IMAGE/PNG; charset=binary", "PNG"),
        (jpeg(), "image/jpeg", "JPEG"),
        (jpeg(), "image/jpg", "JPEG"),
        (gif(3), "image/gif", "GIF"),
    ],
)
@pytest.mark.parametrize("depth", list(ValidationDepth))
def test_good_images_pass(data: bytes, declared: str, fmt: str, depth: ValidationDepth) -> None:
    info = validate_image(data, declared, SETTINGS.model_copy(update={"validation": depth}))
    assert info.format == fmt
    if depth is not ValidationDepth.reencode:
        assert info.data == data
    # Whatever the depth, what comes out validates again as the same format.
    assert validate_image(info.data, declared, SETTINGS).format == fmt


def test_reencode_drops_trailing_bytes() -> None:
    polyglot = png() + b"<script>alert(1)</script>"
    settings = SETTINGS.model_copy(update={"validation": ValidationDepth.reencode})
    info = validate_image(polyglot, "image/png", settings)
    assert b"<script>" not in info.data
    assert validate_image(info.data, "image/png", SETTINGS).width == 8


def test_truncated_images_pass_header_depth_but_not_decode() -> None:
    truncated = noisy_jpeg(64)[:-200]
    header = SETTINGS.model_copy(update={"validation": ValidationDepth.header})
    assert validate_image(truncated, "image/jpeg", header).width == 64
    with pytest.raises(MediaInvalid):
        validate_image(truncated, "image/jpeg", SETTINGS)


def test_minimum_dimensions() -> None:
    settings = SETTINGS.model_copy(update={"min_dimension": 10})
    with pytest.raises(MediaInvalid):
        validate_image(png(9, 200), "image/png", settings)
    assert validate_image(png(10, 10), "image/png", settings).height == 10


def test_format_list_is_explicit() -> None:
    only_png = SETTINGS.model_copy(update={"image_formats": ["PNG"]})
    with pytest.raises(MediaInvalid):
        validate_image(jpeg(), "image/jpeg", only_png)
    with pytest.raises(ValueError):
        check_formats(["PNG", "EPS"])
    with pytest.raises(ValueError):
        check_formats(["SVG"])


@pytest.mark.parametrize(
    ("data", "declared", "error"),
    [
        (wav(), "audio/wav", None),
        (wav(), "audio/x-wav", None),
        (av_sample("tone.mp3"), "audio/mpeg", None),
        (av_sample("tone.flac"), "audio/flac", None),
        (av_sample("tone.ogg"), "audio/ogg", MediaDurationUnknown),  # not timed
        (b"ID3\x03\x00" + b"\x00" * 40, "audio/mpeg", MediaInvalid),  # a tag and no frame
        (wav(), "audio/mpeg", MediaInvalid),  # magic must match the label
        (HTML, "audio/wav", MediaInvalid),
        (SVG, "audio/wav", MediaInvalid),
        (wav(), "image/png", MediaInvalid),
        (wav(), None, MediaInvalid),
        (MP4, "audio/mp4", MediaInvalid),  # m4a is not in the default audio list
        (wav(200_000), "audio/wav", MediaTooLarge),
    ],
)
def test_audio_checks(data: bytes, declared: str | None, error: type[GatewayError] | None) -> None:
    if error is None:
        assert validate_audio(data, declared, SETTINGS).data == data
    else:
        with pytest.raises(error):
            validate_audio(data, declared, SETTINGS)


@pytest.mark.parametrize(
    ("data", "declared", "error"),
    [
        (MP4, "video/mp4", None),
        (WEBM, "video/webm", MediaDurationUnknown),  # not timed
        (WEBM, "video/mp4", MediaInvalid),
        (HTML, "video/mp4", MediaInvalid),
        (MP4, "video/quicktime", MediaInvalid),  # not in the default list
        (MP4, "text/html", MediaInvalid),
        (MP4 + b"\x00" * 200_000, "video/mp4", MediaTooLarge),
    ],
)
def test_video_checks(data: bytes, declared: str, error: type[GatewayError] | None) -> None:
    if error is None:
        assert validate_video(data, declared, SETTINGS).format in ("mp4", "webm")
    else:
        with pytest.raises(error):
            validate_video(data, declared, SETTINGS)


def test_jpeg_frame_video() -> None:
    frames = [jpeg(), jpeg(16, 16)]
    info = validate_jpeg_frames(frames, SETTINGS)
    assert info.frames == tuple(frames)
    with pytest.raises(MediaTooLarge):
        validate_jpeg_frames([jpeg()] * 9, SETTINGS)
    with pytest.raises(MediaInvalid):
        validate_jpeg_frames([jpeg(), png()], SETTINGS)  # every frame must be a JPEG
    with pytest.raises(MediaInvalid):
        validate_jpeg_frames([jpeg(), SVG], SETTINGS)
    with pytest.raises(MediaInvalid):
        validate_jpeg_frames([], SETTINGS)
    assert base64.b64encode(frames[0])  # frames stay separate for the data URL


def _gif(frames: list[tuple[int, int, int, int]], screen: tuple[int, int] = (8, 8)) -> bytes:
    """A GIF with a 2-colour screen and one-pixel-coded frames at (x, y, w, h)."""
    out = b"GIF89a" + struct.pack("<HHBBB", *screen, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    for x, y, w, h in frames:
        out += b"\x2c" + struct.pack("<HHHHB", x, y, w, h, 0) + b"\x02\x02\x44\x01\x00"
    return out + b"\x3b"


def test_a_gif_frame_outside_its_image_is_refused_from_the_header() -> None:
    # A decode grows the image to each frame's extent, past the size the header's caps
    # and the decode budget were read from.
    settings = MediaSettings(validation=ValidationDepth.header)
    assert validate_image(_gif([(0, 0, 8, 8), (0, 0, 8, 8)]), "image/gif", settings)
    for outside in [(0, 0, 9, 8), (4, 0, 8, 8), (0, 7, 1, 2)]:
        with pytest.raises(MediaInvalid):
            validate_image(_gif([(0, 0, 8, 8), outside]), "image/gif", settings)


def test_a_gifs_frames_are_counted_only_up_to_the_cap() -> None:
    # Pillow's n_frames walks every frame before the cap is looked at (a 20 MiB GIF of
    # 1.3 million frames: ~2 s of a decode thread); the walk stops past the cap, so what
    # follows is never read: here a truncated block, which Pillow's walk fails on.
    settings = MediaSettings(max_frames=4)
    over = _gif([(0, 0, 1, 1)] * 5)[:-1] + b"\x21"
    with pytest.raises(MediaTooLarge):
        validate_image(over, "image/gif", settings)
    with pytest.raises(MediaInvalid):
        validate_image(_gif([(0, 0, 1, 1)] * 3)[:-1] + b"\x21", "image/gif", settings)


def _jpeg(segments: bytes = b"") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "JPEG")
    return out.getvalue()[:2] + segments + out.getvalue()[2:]


def _png(chunks: int) -> bytes:
    image = png(8, 8)
    return image[:33] + png_chunk(b"prVt", b"") * chunks + image[33:]


def test_headers_with_more_segments_than_real_files_are_refused() -> None:
    # Pillow walks a JPEG's markers and a PNG's chunks in Python, keeping each comment
    # and private chunk: a 20 MB JPEG of 5 million empty comments took 5 s and ~370 MiB
    # of a decode thread to read its header, outside the decode budget.
    settings = MediaSettings(validation=ValidationDepth.header)
    assert validate_image(_jpeg(b"\xff\xfe\x00\x02" * 100), "image/jpeg", settings)
    assert validate_image(_jpeg(b"\xff" * 100 + b"\xff\xfe\x00\x02"), "image/jpeg", settings)
    assert validate_image(_png(100), "image/png", settings)
    for data, declared in [
        (_jpeg(b"\xff\xfe\x00\x02" * 1100), "image/jpeg"),  # comments
        (_jpeg(b"\xff\xfe\x00\x02" + b"\x00" * 5000), "image/jpeg"),  # junk after one
        (_jpeg(b"\xff" * 5000 + b"\xfe\x00\x02"), "image/jpeg"),  # fill bytes
        (_png(3000), "image/png"),  # empty private chunks
    ]:
        with pytest.raises(MediaInvalid):
            validate_image(data, declared, settings)


def _progressive(side: int, extra_scans: int) -> bytes:
    """A progressive JPEG with its last scan repeated `extra_scans` times."""
    out = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(out, "JPEG", progressive=True)
    data = out.getvalue()
    last, end = data.rindex(b"\xff\xda"), data.rindex(b"\xff\xd9")
    return data[:end] + data[last:end] * extra_scans + data[end:]


def test_a_jpeg_with_more_scans_than_real_files_is_refused() -> None:
    # libjpeg passes over the whole coefficient buffer once a scan, with no limit of its
    # own: 12 ms a scan at 4095 x 4095, so 10,000 repeated 33-byte scans held a decode
    # thread for two minutes.
    settings = MediaSettings()
    assert validate_image(_progressive(64, 0), "image/jpeg", settings)
    assert validate_image(_progressive(64, 50), "image/jpeg", settings)
    with pytest.raises(MediaInvalid):
        validate_image(_progressive(64, 200), "image/jpeg", settings)
