"""`decodes`: whether Pillow's decode of a PNG is certain to succeed, found without it.

At depth `decode` a PNG's check is Pillow's decode, and Pillow inflates with the
system's zlib: 4.5 ms for a 672 x 672 RGB image here, 2.8 ms of it inflating. The same
rows inflate with zlib-ng in 0.11 ms, and their filter bytes are read in 0.01 ms. For
the common layout the verdict is the same (Pillow 13: `decode.c`, `ZipDecode.c`,
`ImageFile.load`, `PngImagePlugin.load_end`, `Image.load`):

- Pillow refuses a row longer than INT_MAX bits, and an image wider than INT_MAX / 4 - 1
  pixels, before decoding.
- Pillow's decode of a non-interlaced PNG fails when inflating fails, or when a row's
  filter type is not 0-4, before the image's last row is had: it stops there.
- It also fails when the IDAT data runs out while rows are still to come, even if the
  inflater holds them: Pillow asks for more input rather than for the rows. A stream
  that goes on to its end (the block's end, then a valid Adler-32) has that input, and
  inflating does not read the checksum until every byte of output is written.
- Once the rows are had, Pillow reads the chunks after them up to IEND, and refuses
  only a chunk it cannot read whole. Only IDAT and then IEND are let follow here.
- Of what Pillow does after decoding, only setting a palette can fail, so an image
  Pillow gave a palette (a palette image, or a PLTE before a second IHDR) is left to
  Pillow.

Everything else (interlaced, animated, a palette, more output than the image, any other
chunk after the data) goes to Pillow, and so does every PNG this check does not pass: a
"no" here is never a refusal. A "yes" is certain: the image would decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from PIL import Image, PngImagePlugin
from zlib_ng import zlib_ng

# Bits a pixel of each raw mode Pillow decodes a PNG into, but palettes
# (PngImagePlugin._MODES). A raw mode not here is left to Pillow.
_BITS = {
    "1": 1,
    "L;2": 2,
    "L;4": 4,
    "L": 8,
    "I;16B": 16,
    "RGB": 24,
    "RGB;16B": 48,
    "LA": 16,
    "LA;16B": 32,
    "RGBA": 32,
    "RGBA;16B": 64,
}
_INT_MAX = 2**31 - 1
# Bytes of rows inflated at a time, whatever a row's length, and compressed bytes handed
# to the inflater at a time: what is held, and what the inflater copies as its
# unconsumed input, stays this small.
_OUTPUT = 1 << 20
_INPUT = 1 << 16
# Compressed bytes read, after the piece that held the last row, to find the stream's
# end. An encoder leaves a few (the block's end, an empty block of a flush); more is
# left to Pillow, which stops at the last row: 20 MB of empty blocks there took 2 s to
# inflate, Pillow's decode 0.03 s.
_TAIL = 1 << 10
_FILTERS = bytes(range(5))
# A PNG file's first eight bytes.
SIGNATURE = b"\x89PNG\r\n\x1a\n"
# zlib_ng's stub declares its error class as an instance of Exception.
_INFLATE_ERROR = cast("type[Exception]", zlib_ng.error)


def decodes(data: bytes, image: Image.Image) -> bool:
    """True when Pillow's decode of `data`, opened by Pillow as `image`, will succeed."""
    if not isinstance(image, PngImagePlugin.PngImageFile):
        return False
    if image.info.get("interlace") or image.is_animated or image.palette is not None:
        return False
    if not image.tile or len(image.tile) != 1:  # None without an IDAT before Pillow 11.0
        return False
    # A plain tuple before Pillow 11.0, a named one since: unpacked, either works.
    codec, extents, offset, args = image.tile[0]
    bits = _BITS.get(args) if isinstance(args, str) else None
    if codec != "zip" or bits is None or extents != (0, 0, *image.size):
        return False
    width, height = image.size
    # decode.c refuses a row of more than INT_MAX bits, and Storage.c an image more than
    # INT_MAX / 4 - 1 pixels wide in any mode (both MemoryError): a 1- or 2-bit row
    # meets the second first.
    if width > min(_INT_MAX // bits - 7, _INT_MAX // 4 - 1):
        return False
    parts = _image_data(data, offset)
    if parts is None:
        return False
    stride = 1 + (bits * width + 7) // 8  # a row: its filter type, then its bytes
    try:
        return _rows_then_end(_pieces(parts), stride, stride * height)
    except _INFLATE_ERROR:
        return False


def _rows_then_end(pieces: Iterator[memoryview], stride: int, need: int) -> bool:
    """The stream in `pieces` inflates to `need` bytes of rows, each starting with a
    filter type of 0-4, and then ends, with no more output, within `pieces` and within
    `_TAIL` bytes of the piece that held the last row."""
    inflate = zlib_ng.decompressobj()
    pending: bytes | memoryview = b""
    had = 0
    while had < need:
        if inflate.eof:
            return False  # the stream ends before the image does
        if not pending:
            pending = next(pieces, b"")
            if not pending:
                return False  # the data ends before the image does
        rows = inflate.decompress(pending, min(_OUTPUT, need - had))
        pending = inflate.unconsumed_tail
        # A row's filter type is at each multiple of `stride` from the first byte (a
        # piece may start and end inside a row).
        if rows[(-had) % stride :: stride].translate(None, _FILTERS):
            return False
        had += len(rows)
    left = _TAIL
    while not inflate.eof:
        if not pending:
            pending = next(pieces, b"")
        if not pending or not left:
            return False  # no end (Pillow may be left asking for input), or a far one
        piece, pending = pending[:left], pending[left:]
        left -= len(piece)
        # No output allowed, so all of `piece` is read unless the stream ends in it.
        if inflate.decompress(piece, 1):
            return False  # more output than the image: left to Pillow
    return True


def _pieces(parts: list[memoryview]) -> Iterator[memoryview]:
    for part in parts:
        for at in range(0, len(part), _INPUT):
            yield part[at : at + _INPUT]


def chunks(data: bytes, at: int = 8) -> Iterator[tuple[bytes, int, int]]:
    """Each chunk of the PNG `data` from the one at `at` (the first after the signature
    by default): its type, where its data starts and the length its header gives, for
    as long as a chunk's length and type are within `data`. The one walk of a PNG's
    chunks: the structure check counts them (images.py), `decodes` reads the IDATs."""
    end = len(data)
    while at + 8 <= end:
        length = int.from_bytes(data[at : at + 4], "big")
        yield data[at + 4 : at + 8], at + 8, length
        at += 12 + length


def _image_data(data: bytes, offset: int) -> list[memoryview] | None:
    """The IDAT chunks' data, from the first one's (at `offset`, as Pillow found it),
    when they follow one another whole and IEND follows them; else None."""
    view = memoryview(data)
    parts: list[memoryview] = []
    for kind, start, length in chunks(data, offset - 8):
        if kind != b"IDAT":
            return parts if parts and kind == b"IEND" else None
        if start + length + 4 > len(data):  # its data and its CRC
            return None
        parts.append(view[start : start + length])
    return None  # the file ends among the IDATs
