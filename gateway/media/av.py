"""Audio and video checks: a type allowlist, magic bytes that match the declared type,
the container's first structures, size caps, and a frame cap for `data:video/jpeg`
(comma-separated base64 JPEG frames, the form vLLM decodes frame by frame, docs/vllm.md).

The gateway does not decode audio or video (that needs codecs it should not carry).
The engine hands the bytes to FFmpeg (or libsndfile), which picks a demuxer by probing
the content, not by the declared type. So a magic prefix is not enough: FFmpeg skips an
ID3v2 tag before probing, and some of its text formats (HLS, DASH, SDP, ffconcat) open
other URLs or files. The checks here parse each container as far as its first real
chunk, box, page or element, and refuse bytes in which one of those text formats could
be found.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.errors import MediaDurationUnknown, MediaInvalid, MediaTooLarge
from gateway.media.duration import duration
from gateway.media.images import ImageHeader, base_type, decode_image, read_header
from gateway.media.mpeg import SAME_STREAM, id3_length, mpeg_frame
from gateway.media.settings import MediaSettings
from gateway.media.types import AUDIO_TYPES, VIDEO_TYPES


@dataclass(frozen=True)
class AvInfo:
    format: str
    mime: str
    data: bytes
    frames: tuple[bytes, ...] = ()  # the JPEG frames of `video/jpeg`
    # How long it plays, from its headers; None: unknown (`media.allow_unknown_duration`).
    seconds: float | None = None


def sniff(data: bytes) -> str | None:
    """The container format named by the magic bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"  # EBML: WebM and Matroska share it
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if brand in (b"M4A ", b"M4B "):
            return "m4a"
        if brand == b"qt  ":
            return "mov"
        return "mp4"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _mp3(data: bytes) -> bool:
    """An optional ID3v2 tag, then an MPEG audio frame, then another frame of the same
    stream where the first one ends (or the end, or an ID3v1 tag): what FFmpeg's mp3
    probe looks for after the tag."""
    start = id3_length(data)
    first = mpeg_frame(data, start)
    if first is None:
        return False
    header, length = first
    after = start + length
    if after >= len(data) or data[after : after + 3] == b"TAG":
        return True
    second = mpeg_frame(data, after)
    return second is not None and second[0] & SAME_STREAM == header & SAME_STREAM


def _fourcc(name: bytes) -> bool:
    return len(name) == 4 and all(0x20 <= b < 0x7F for b in name)


def _wav(data: bytes) -> bool:
    """RIFF/WAVE, then chunks (at most 16: LIST, JUNK, bext...) up to a `fmt ` chunk
    that holds a format tag, channels and a sample rate, before any `data` chunk."""
    if len(data) < 12 or int.from_bytes(data[4:8], "little") < 4 + 8 + 16:
        return False
    at = 12
    for _ in range(16):
        name, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        if not _fourcc(name) or at + 8 + size > len(data) or name == b"data":
            return False
        if name == b"fmt ":
            if size < 16:
                return False
            tag, channels, rate = struct.unpack_from("<HHI", data, at + 8)
            return bool(tag and channels and rate)
        at += 8 + size + (size & 1)
    return False


def _flac(data: bytes) -> bool:
    """`fLaC`, a STREAMINFO block, the other metadata blocks up to the last one, then a
    frame sync (or the end)."""
    at, first = 4, True
    for _ in range(128):
        if at + 4 > len(data):
            return False
        kind, size = data[at] & 0x7F, int.from_bytes(data[at + 1 : at + 4], "big")
        if first:
            if kind != 0 or size != 34 or at + 4 + size > len(data):
                return False
            min_block, max_block = struct.unpack_from(">HH", data, at + 4)
            rate = int.from_bytes(data[at + 14 : at + 17], "big") >> 4
            if min_block < 16 or max_block < min_block or rate == 0:
                return False
        elif not 1 <= kind <= 6:
            return False
        last, at, first = data[at] & 0x80, at + 4 + size, False
        if at > len(data):
            return False
        if last:
            return at == len(data) or data[at : at + 2] in (b"\xff\xf8", b"\xff\xf9")
    return False


def _ogg(data: bytes) -> bool:
    """A first Ogg page (version 0, beginning of stream, not a continuation) that fits,
    followed by another page or the end."""
    if len(data) < 27 or data[4] != 0 or data[5] & 0xFB != 0x02 or data[26] == 0:
        return False
    table = 27 + data[26]
    end = table + sum(data[27:table])
    if table > len(data) or end > len(data):
        return False
    return end == len(data) or data[end : end + 5] == b"OggS\x00"


def _iso(data: bytes) -> bool:
    """An `ftyp` box of sane size (a brand, a version, whole compatible brands), then
    another box whose size fits in the data."""
    size = int.from_bytes(data[:4], "big")
    if not 16 <= size <= 1024 or size % 4 or size + 8 > len(data):
        return False
    box, name = int.from_bytes(data[size : size + 4], "big"), data[size + 4 : size + 8]
    if not _fourcc(name):
        return False
    if box == 0:  # to the end of the file
        return True
    if box == 1:  # a 64-bit size follows the name
        large = int.from_bytes(data[size + 8 : size + 16], "big")
        return size + 16 <= len(data) and 16 <= large <= len(data) - size
    return 8 <= box <= len(data) - size


def _vint(data: bytes, at: int, keep_marker: bool) -> tuple[int, int] | None:
    """(value, length) of the EBML variable-length integer at `at`, or None."""
    if at >= len(data) or data[at] == 0:
        return None
    length = 9 - data[at].bit_length()
    if at + length > len(data):
        return None
    value = int.from_bytes(data[at : at + length], "big")
    return (value if keep_marker else value & ((1 << (7 * length)) - 1)), length


def _ebml(data: bytes) -> bool:
    """An EBML header (at most 1 KiB) whose elements fit in it and whose DocType is
    `webm` or `matroska`, followed by a Segment element."""
    size = _vint(data, 4, keep_marker=False)
    if size is None:
        return False
    at, end = 4 + size[1], 4 + size[1] + size[0]
    if size[0] > 1024 or end + 4 > len(data):  # real headers take some 40 bytes
        return False
    doctype = b""
    while at < end:
        element = _vint(data, at, keep_marker=True)
        size = None if element is None else _vint(data, at + element[1], keep_marker=False)
        if element is None or size is None:
            return False
        body = at + element[1] + size[1]
        if body + size[0] > end:
            return False
        if element[0] == 0x4282:
            doctype = data[body : body + size[0]].rstrip(b"\0")
        at = body + size[0]
    return doctype in (b"webm", b"matroska") and data[end : end + 4] == b"\x18\x53\x80\x67"


_WELL_FORMED: dict[str, Callable[[bytes], bool]] = {
    "wav": _wav,
    "mp3": _mp3,
    "flac": _flac,
    "ogg": _ogg,
    "mp4": _iso,
    "m4a": _iso,
    "mov": _iso,
    "webm": _ebml,
}

# FFmpeg's text formats that open other URLs or files, as its probes find them: an HLS
# playlist or an ffconcat script at the start, a DASH manifest or an IMF composition
# anywhere before the first NUL byte, an SDP description's lines. Lower case: the window
# is lowered first (DASH's probe ignores case).
_TEXT_FORMATS = (b"#extm3u", b"ffconcat", b"<mpd", b"<?xml", b"<compositionplaylist")
_SDP_LINES = (b"v=0", b"c=in ip")
_PROBE_BYTES = 1 << 20  # FFmpeg's largest probe buffer
# The line SDP's probe looks for, as it compares it (case and all), after a line feed.
_SDP_PROBE_LINES = (b"\nc=IN IP", b"\n\rc=IN IP")


def carries_text_format(data: bytes) -> bool:
    """Whether FFmpeg's probes could read one of those text formats in `data`.

    FFmpeg skips an ID3v2 tag only when the tag fits in its probe buffer, so the text up
    to the first NUL byte is read both after the tag and from byte 0 (a real tag's
    header has a NUL at its fifth byte, so that window is four bytes long). SDP's probe
    looks at every line start and steps over NUL bytes inside a line: its `c=IN IP`
    line is looked for in the whole probe buffer, from both places."""
    start = max(id3_length(data), 0)
    for at in (0, start) if start else (0,):
        end = data.find(b"\0", at, at + _PROBE_BYTES)
        window = data[at : end if end >= 0 else at + _PROBE_BYTES].lower()
        if window.startswith(_SDP_LINES) or any(s in window for s in _TEXT_FORMATS):
            return True
        if any(b + line in window for b in (b"\n", b"\r") for line in _SDP_LINES):
            return True
        if any(data.find(line, at, at + _PROBE_BYTES) >= 0 for line in _SDP_PROBE_LINES):
            return True
    return False


def well_formed(format_name: str, data: bytes) -> bool:
    """Whether `data` parses as the sniffed container as far as its first structures
    and holds no FFmpeg text format where FFmpeg's probes look."""
    check = _WELL_FORMED.get(format_name)
    return check is not None and check(data) and not carries_text_format(data)


def _compatible(sniffed: str, declared_format: str) -> bool:
    if sniffed == declared_format:
        return True
    # MP4 and M4A share the ISO container; Matroska and WebM share EBML.
    return {sniffed, declared_format} in ({"mp4", "m4a"}, {"webm", "mkv"}, {"mp4", "mov"})


def _validate(
    data: bytes,
    declared: str | None,
    table: dict[str, frozenset[str]],
    allowed: Sequence[str],
    settings: MediaSettings,
    max_seconds: float,
) -> AvInfo:
    if len(data) > settings.max_bytes:
        raise MediaTooLarge("The media item is larger than this gateway accepts.")
    mime = base_type(declared)
    names = [name for name in allowed if mime is not None and mime in table.get(name, ())]
    if not names:
        raise MediaInvalid("The declared media type is not allowed.")
    sniffed = sniff(data)
    if sniffed is None or not any(_compatible(sniffed, name) for name in names):
        raise MediaInvalid("The media bytes do not match the declared type.")
    if not well_formed(sniffed, data):
        raise MediaInvalid("The media bytes are not a well-formed file of the declared type.")
    # The engine decodes (and resamples) the whole item: a 20 MiB file at a low bit rate
    # or sample rate is hours of samples. Read from the headers, before it is forwarded.
    # Unknown is refused unless allowed: no byte rate bounds what such a file decodes to.
    seconds = duration(sniffed, data)
    if seconds is None:
        if not settings.allow_unknown_duration:
            raise MediaDurationUnknown(
                "The media item's headers do not say how long it plays; "
                "this gateway accepts only items it can time."
            )
    elif seconds > max_seconds:
        raise MediaTooLarge("The media item plays longer than this gateway accepts.")
    return AvInfo(names[0], mime or "", data, seconds=seconds)


def validate_audio(data: bytes, declared: str | None, settings: MediaSettings) -> AvInfo:
    return _validate(
        data, declared, AUDIO_TYPES, settings.audio_formats, settings, settings.max_audio_seconds
    )


def audio_type(format_name: object) -> str | None:
    """The MIME type for an `input_audio.format` value ("wav", "mp3", ...)."""
    if not isinstance(format_name, str):
        return None
    types = AUDIO_TYPES.get(format_name.lower())
    return min(types) if types else None


def validate_video(data: bytes, declared: str | None, settings: MediaSettings) -> AvInfo:
    """A video container. `video/jpeg` is only a data: URL's list of JPEG frames
    (`read_jpeg_frames`); bytes declared as one have no frames."""
    if base_type(declared) == "video/jpeg":
        raise MediaInvalid("The video has no frames.")
    return _validate(
        data, declared, VIDEO_TYPES, settings.video_formats, settings, settings.max_video_seconds
    )


def read_jpeg_frames(frames: Sequence[bytes], settings: MediaSettings) -> list[ImageHeader]:
    """The headers of a `data:video/jpeg` URL's frames, each checked as a JPEG's, and the
    frame and size caps. Synchronous (Pillow)."""
    if not frames:
        raise MediaInvalid("The video has no frames.")
    if len(frames) > settings.max_frames:
        raise MediaTooLarge("The video has more frames than this gateway accepts.")
    if sum(len(f) for f in frames) > settings.max_bytes:
        raise MediaTooLarge("The media item is larger than this gateway accepts.")
    return [read_header(f, "image/jpeg", settings, formats=("JPEG",)) for f in frames]


def decode_jpeg_frames(
    frames: Sequence[bytes], headers: Sequence[ImageHeader], settings: MediaSettings
) -> AvInfo:
    """The frames decoded one after the other (one frame's buffer at a time)."""
    checked = [decode_image(f, h, settings).data for f, h in zip(frames, headers, strict=True)]
    return AvInfo("jpeg", "video/jpeg", b"".join(checked), tuple(checked))
