"""Sample media, built in memory: images for the bench's workloads and the tests'
payloads, and files of the kinds the gateway must refuse (tests/unit/media/test_samples.py
checks that each is what its name says)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def encode(image: Image.Image, format: str) -> bytes:
    """`image` saved in `format` ("PNG", "JPEG")."""
    out = io.BytesIO()
    image.save(out, format=format)
    return out.getvalue()


def png(width: int = 8, height: int = 8, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    return encode(Image.new("RGB", (width, height), color), "PNG")


def jpeg(width: int = 8, height: int = 8) -> bytes:
    return encode(Image.new("RGB", (width, height), (10, 120, 200)), "JPEG")


def noisy_jpeg(size: int = 64) -> bytes:
    """A JPEG whose scan data dominates, so cutting its tail leaves the header whole."""
    return encode(Image.effect_noise((size, size), 80).convert("RGB"), "JPEG")


def gif(frames: int, size: int = 4) -> bytes:
    # Each frame differs from the last, or Pillow merges them when saving.
    images = [Image.new("RGB", (size, size), (i % 2 * 255, 0, 0)) for i in range(frames)]
    out = io.BytesIO()
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=10)
    return out.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """A PNG chunk: its length, `kind`, `data` and its CRC."""
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height: a decompression bomb's first bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat)


def wav(samples: int = 800) -> bytes:
    data = b"\x00\x00" * samples
    fmt = struct.pack("<HHIIHH", 1, 1, 8000, 16000, 2, 16)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


SVG = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"><image href="http://169.254.169.254/"/></svg>'
HTML = b"<!DOCTYPE html><html><body><script>alert(1)</script></body></html>"
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n(/etc/passwd) (r) file\nshowpage\n"
# The first structures of an MP4 (an `ftyp` box, a `moov` whose `mvhd` says one second,
# then an `mdat` box) and of a WebM (an EBML header naming `webm`, then a Segment of
# unknown size): what the gateway checks of a video container (gateway/media/av.py,
# duration.py; a WebM's duration is not read). The payloads are not decodable video.
_MVHD = bytes(4) + struct.pack(">IIII", 0, 0, 1000, 1000) + bytes(80)
MP4 = (
    b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"
    + struct.pack(">I", 16 + len(_MVHD))
    + b"moov"
    + struct.pack(">I", 8 + len(_MVHD))
    + b"mvhd"
    + _MVHD
    + struct.pack(">I", 72)
    + b"mdat"
    + bytes(64)
)
WEBM = (
    b"\x1a\x45\xdf\xa3\x9f"
    + b"\x42\x86\x81\x01\x42\xf7\x81\x01\x42\xf2\x81\x04\x42\xf3\x81\x08"
    + b"\x42\x82\x84webm\x42\x87\x81\x02\x42\x85\x81\x02"
    + b"\x18\x53\x80\x67\x01\xff\xff\xff\xff\xff\xff\xff"
    + bytes(64)
)


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
