"""The PNG check that stands in for Pillow's decode (gateway/media/png.py), against
Pillow's own decode: a PNG it passes always decodes; every PNG keeps the verdict a full
decode gives it, whether the check passed it or Pillow decided."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from bench.harness.samples import png_chunk
from gateway.errors import MediaInvalid
from gateway.media import png
from gateway.media.settings import MediaSettings
from tests.unit.media.image_validation import validate_image

DECODE = MediaSettings()
# (bit depth, colour type) of every PNG without a palette, and channels per pixel.
PLAIN = [(1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (8, 2), (16, 2), (8, 4), (16, 4), (8, 6), (16, 6)]
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _ihdr(width: int, height: int, bits: int, color: int, interlace: int = 0) -> bytes:
    return png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bits, color, 0, 0, interlace))


def raw_rows(
    width: int, height: int, bits: int, color: int, filters: list[int], seed: int
) -> bytes:
    """Raw rows: each a filter type from `filters`, then bytes drawn from `seed`."""
    stride = (bits * CHANNELS[color] * width + 7) // 8
    fill = bytes((seed * 31 + i * 7) % 256 for i in range(stride))
    return b"".join(bytes([filters[y % len(filters)]]) + fill for y in range(height))


def png_file(
    width: int,
    height: int,
    bits: int = 8,
    color: int = 2,
    *,
    rows: bytes | None = None,
    stream: bytes | None = None,
    splits: int = 1,
    after: list[bytes] | None = None,
    interlace: int = 0,
    palette: bytes = bytes(range(48)),
) -> bytes:
    """A PNG written chunk by chunk: `palette` for colour type 3, `stream` (else `rows`
    compressed) over `splits` IDAT chunks, the chunks `after`, then IEND."""
    if stream is None:
        stream = zlib.compress(
            rows if rows is not None else raw_rows(width, height, bits, color, [0], 1)
        )
    step = -(-len(stream) // splits)
    idat = [png_chunk(b"IDAT", stream[i : i + step]) for i in range(0, len(stream), step)]
    plte = [png_chunk(b"PLTE", palette)] if color == 3 else []
    return b"".join(
        [b"\x89PNG\r\n\x1a\n", _ihdr(width, height, bits, color, interlace), *plte, *idat,
         *(after or []), png_chunk(b"IEND", b"")]
    )  # fmt: skip


def _pillow_decodes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            image.load()
    except Exception:
        return False
    return True


def _check(data: bytes) -> bool:
    with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
        return png.decodes(data, image)


def _gateway_passes(data: bytes) -> bool:
    try:
        validate_image(data, "image/png", DECODE)
    except MediaInvalid:
        return False
    return True


@pytest.mark.parametrize(("bits", "color"), PLAIN)
def test_every_plain_layout_is_checked_without_pillows_decode(bits: int, color: int) -> None:
    data = png_file(
        13, 9, bits, color, rows=raw_rows(13, 9, bits, color, [0, 1, 2, 3, 4], 5), splits=3
    )
    assert _pillow_decodes(data)
    assert _check(data)
    assert _gateway_passes(data)


def test_an_encoders_png_is_checked_without_pillows_decode() -> None:
    image = Image.effect_noise((300, 200), 60).convert("RGB")
    for mode in ("RGB", "RGBA", "L", "LA", "1", "I;16"):
        out = io.BytesIO()
        image.convert(mode).save(out, "PNG")
        assert _check(out.getvalue()), mode


def test_chunks_walks_a_png_to_its_last_whole_chunk_header() -> None:
    data = png_file(4, 4, splits=2, after=[png_chunk(b"tEXt", b"k\0v")])
    walk = list(png.chunks(data))
    assert [kind for kind, _, _ in walk] == [b"IHDR", b"IDAT", b"IDAT", b"tEXt", b"IEND"]
    _, start, length = walk[3]
    assert data[start : start + length] == b"k\0v"
    # A chunk header cut short ends the walk (IEND's, here).
    assert [kind for kind, _, _ in png.chunks(data[:-5])][-1] == b"tEXt"
    # A length past the file's end is given as the header says: the caller decides.
    past = data[:33] + struct.pack(">I", 10**6) + b"prVt"
    assert list(png.chunks(past))[-1] == (b"prVt", 41, 10**6)


def _rows_with(filter_type: int, at_row: int) -> bytes:
    rows = bytearray(raw_rows(20, 10, 8, 2, [0, 4], 3))
    rows[at_row * (1 + 60)] = filter_type
    return bytes(rows)


STREAM = zlib.compress(raw_rows(20, 10, 8, 2, [1, 2], 7))


def _shortest_stream(rows: bytes) -> bytes:
    """`rows` compressed, cut to the shortest start that still inflates to all of them:
    its last bytes are read while the inflater still holds rows to write, so Pillow,
    which asks for more input instead, finds the data ended (found by an attack)."""
    stream = zlib.compress(rows, 9)
    return next(
        stream[:cut]
        for cut in range(2, len(stream))
        if len(zlib.decompressobj().decompress(stream[:cut], len(rows))) == len(rows)
    )


def _far_end(rows: bytes, empty_blocks: int) -> bytes:
    """`rows` compressed, then `empty_blocks` stored blocks of no bytes, then the end:
    a stream whose end lies far past its last row (found by an attack: 20 MB of empty
    blocks took the check 2 s to reach the end, Pillow 0.03 s, as it stops at the
    last row)."""
    deflate = zlib.compressobj()
    stream = deflate.compress(rows) + deflate.flush(zlib.Z_SYNC_FLUSH)
    empty = b"\x00\x00\x00\xff\xff" * empty_blocks  # not final, stored, 0 bytes
    return stream + empty + b"\x03\x00" + zlib.adler32(rows).to_bytes(4, "big")


PENDING = _shortest_stream(bytes(32 * (1 + 3 * 32)))
# A palette image's header, its palette, then an RGB header: Pillow decodes the rows as
# RGB and then fails to set the palette it kept (found by an attack).
TWO_HEADERS = b"".join(
    [b"\x89PNG\r\n\x1a\n", _ihdr(32, 32, 8, 3), png_chunk(b"PLTE", bytes(12)), _ihdr(32, 32, 8, 2),
     png_chunk(b"IDAT", zlib.compress(raw_rows(32, 32, 8, 2, [0], 1))), png_chunk(b"IEND", b"")]
)  # fmt: skip


@pytest.mark.parametrize(
    ("data", "decodes"),
    [
        # Refused by Pillow, and so by the gateway.
        pytest.param(png_file(20, 10, rows=_rows_with(5, 0)), False, id="filter 5, first row"),
        pytest.param(png_file(20, 10, rows=_rows_with(255, 9)), False, id="filter 255, last row"),
        pytest.param(png_file(20, 10, stream=STREAM[:-30]), False, id="stream cut"),
        pytest.param(png_file(20, 10, stream=STREAM[:2] + b"\xff" * 8 + STREAM[10:]), False,
                     id="corrupt stream"),
        pytest.param(png_file(20, 10, stream=b"\x78\x9c" + STREAM[:20]), False,
                     id="bad stream header"),
        pytest.param(png_file(20, 10, stream=STREAM, after=[struct.pack(">I", 1000) + b"abCd"]),
                     False, id="a chunk after the data longer than the file"),
        pytest.param(png_file(20, 10, stream=STREAM)[:-40], False, id="file cut"),
        pytest.param(png_file(32, 32, stream=PENDING), False, id="input ends before the last rows"),
        pytest.param(TWO_HEADERS, False, id="a palette left on an RGB image by a second IHDR"),
        # Rows that decode, then a palette Pillow cannot take (over 256 colours).
        pytest.param(png_file(20, 10, color=3, rows=raw_rows(20, 10, 8, 3, [0], 1),
                              palette=bytes(800)), False, id="palette too long"),
        # Decoded by Pillow, not by this check: the gateway passes them all the same.
        pytest.param(png_file(20, 10, stream=zlib.compress(raw_rows(20, 6, 8, 2, [0], 2))), True,
                     id="stream ends before the image"),
        pytest.param(png_file(20, 10, stream=STREAM, after=[png_chunk(b"tEXt", b"k\0v")]), True,
                     id="a text chunk after the data"),
        pytest.param(png_file(20, 10, color=3, rows=raw_rows(20, 10, 8, 3, [0], 1)), True,
                     id="palette"),
        pytest.param(png_file(20, 10, stream=STREAM)[:-12], True, id="no IEND"),
        pytest.param(png_file(20, 8, stream=STREAM), True, id="more rows than the image"),
        pytest.param(png_file(20, 10, stream=STREAM[:-4]), True, id="no checksum"),
        pytest.param(png_file(20, 10, stream=_far_end(raw_rows(20, 10, 8, 2, [1], 7), 14_000)),
                     True, id="the stream's end 70 KB past the last row"),
    ],
)  # fmt: skip
def test_a_png_the_check_does_not_pass_gets_pillows_verdict(data: bytes, decodes: bool) -> None:
    assert not _check(data)
    assert _pillow_decodes(data) is decodes
    assert _gateway_passes(data) is decodes


def test_a_few_empty_blocks_before_the_end_are_checked() -> None:
    # An encoder's flushes leave a few bytes between the last row and the end.
    data = png_file(20, 10, stream=_far_end(raw_rows(20, 10, 8, 2, [1], 7), 20))
    assert _check(data)
    assert _pillow_decodes(data)


def test_an_interlaced_png_is_left_to_pillow() -> None:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(out, "PNG")
    with Image.open(out) as image:
        image.info["interlace"] = 1  # as Pillow records an interlaced file's header
        assert not png.decodes(out.getvalue(), image)


def _zero_row(size: int, level: int) -> bytes:
    """A stream of `size` zero bytes (one row of a very wide image), compressed a MiB at
    a time so that the row is never held whole."""
    piece, deflate = bytes(1 << 20), zlib.compressobj(level)
    parts = [
        deflate.compress(piece[: min(len(piece), size - at)]) for at in range(0, size, len(piece))
    ]
    return b"".join(parts) + deflate.flush()


def test_a_row_longer_than_pillow_decodes_is_left_to_pillow() -> None:
    # Only with max_pixels raised past 33.5 M (found by an attack): decode.c refuses a
    # row of more than INT_MAX / bits - 7 pixels before decoding it.
    width = 33_554_425
    data = png_file(width, 1, 16, 6, stream=_zero_row(1 + 8 * width, level=1))
    assert not _check(data)
    assert not _pillow_decodes(data)


def test_an_image_wider_than_pillow_allocates_is_left_to_pillow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only with Pillow's own pixel limit lifted and max_pixels past 536.9 M (found by a
    # review across Pillow 10.3-13.0): Storage.c refuses an image more than
    # INT_MAX / 4 - 1 pixels wide in any mode, a 1-bit row of which decode.c still takes.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    width = 2**31 // 4 - 1
    data = png_file(width, 1, 1, 0, stream=_zero_row(1 + (width + 7) // 8, level=9))
    assert not _check(data)
    assert not _pillow_decodes(data)


def test_a_png_without_image_data_is_left_to_pillow() -> None:
    # Pillow gives it no tile: [] since 11.0, None before (a TypeError here once).
    data = b"".join([png.SIGNATURE, _ihdr(4, 3, 8, 2), png_chunk(b"IEND", b"")])
    with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
        for tile in ([], None):
            image.tile = tile
            assert not png.decodes(data, image)
    assert not _pillow_decodes(data)
    assert not _gateway_passes(data)


@st.composite
def _damaged_pngs(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A PNG of any plain layout, often damaged; and whether it was left whole."""
    bits, color = draw(st.sampled_from(PLAIN))
    width, height = draw(st.integers(1, 40)), draw(st.integers(1, 12))
    filters = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    rows = raw_rows(width, height, bits, color, filters, draw(st.integers(0, 255)))
    stream = zlib.compress(rows, draw(st.integers(0, 9)))
    data = png_file(width, height, bits, color, stream=stream, splits=draw(st.integers(1, 4)))
    whole = True
    for _ in range(draw(st.integers(0, 3))):
        if len(data) <= 34:
            break
        at = draw(st.integers(33, len(data) - 1))
        how = draw(st.sampled_from(["flip", "cut", "cut stream", "filter"]))
        if how == "cut":
            data = data[:at]
        elif how == "cut stream":  # the rows' stream cut, in a file otherwise whole
            cut = stream[: draw(st.integers(1, len(stream) - 1))]
            data = png_file(width, height, bits, color, stream=cut, splits=draw(st.integers(1, 3)))
        elif how == "flip":
            data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
        else:
            bad = bytearray(rows)
            bad[draw(st.integers(0, height - 1)) * (len(rows) // height)] = draw(
                st.integers(5, 255)
            )
            data = png_file(width, height, bits, color, stream=zlib.compress(bytes(bad)))
        whole = False
    if whole and draw(st.booleans()):  # more rows than the image: left to Pillow, decoded
        data = png_file(width, height - 1, bits, color, stream=stream) if height > 1 else data
        whole = height == 1
    return data, whole


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_damaged_pngs())
def test_the_check_never_passes_a_png_pillow_would_refuse(case: tuple[bytes, bool]) -> None:
    data, whole = case
    try:
        checked = _check(data)
    except Exception:
        checked = False  # Pillow could not open it: the header read refuses it first
    pillow = _pillow_decodes(data)
    if checked:
        assert pillow
    if whole:
        assert checked
    assert _gateway_passes(data) is pillow
