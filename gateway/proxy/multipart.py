"""Validating multipart audio uploads (/v1/audio/transcriptions, /v1/audio/translations).

The proxy reads the body under its own size cap (`limits.max_upload_bytes`), then:

    upload = validate_upload(headers.get("content-type"), body, settings.media,
                             max_file_bytes=settings.limits.max_upload_bytes)

and forwards the original bytes unchanged only if this returns. The body is parsed with
python-multipart under caps on parts, header sizes and field sizes; exactly one `file`
part is required and its bytes must be an allowed audio container whose magic bytes
match. Raises `UnsupportedMediaType` (not multipart), `InvalidRequest` (malformed),
`FieldNotAllowed`, `MediaInvalid` or `MediaTooLarge`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.errors import (
    FieldNotAllowed,
    InvalidRequest,
    MediaInvalid,
    MediaTooLarge,
    UnsupportedMediaType,
)
from gateway.media.av import sniff, validate_audio
from gateway.media.settings import MediaSettings
from gateway.media.types import AUDIO_TYPES
from gateway.payload.rules import FORBIDDEN_FORM_FIELDS

_MAX_HEADER_BYTES = 4096
# RFC 2046 boundary characters (no trailing space). Anything else is refused, so the
# boundary can be forwarded quoted in a Content-Type the gateway writes itself.
_BOUNDARY = re.compile(rb"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
# Field names the gateway reads the same way as the engine's form parser, whatever
# charset that parser would decode with (Starlette decodes names and values with the
# Content-Type's charset: `charset=utf-7` turns `+AG0-odel` into `model` there).
_FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]]{1,64}")
# Bytes a part header value may not carry: controls other than tab, DEL, C1 controls and
# the no-break space (which Python's str.strip() removes and Starlette keeps).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f-\x9f\xa0]")


@dataclass
class _Part:
    headers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    name: str = ""
    filename: str | None = None


@dataclass(frozen=True)
class Upload:
    fields: dict[str, list[str]]
    boundary: bytes  # as parsed: the one the forwarded Content-Type names
    # How long the file plays, from its headers; None: unknown (allowed by
    # `media.allow_unknown_duration`). Weighs the request (payload/sequences.py).
    seconds: float | None = None

    @property
    def model(self) -> str | None:
        """The `model` form field, None when absent. vLLM resolves it like a JSON
        body's `model` (unknown names go on to the LoRA resolvers), so the proxy checks
        it the same way; `_check` has refused a second `model` field."""
        values = self.fields.get("model")
        return values[0] if values else None


def _boundary(content_type: str | None) -> bytes:
    """The boundary of a `multipart/form-data` Content-Type that has no parameter but
    the boundary (and a UTF-8 charset): any other charset changes how the engine's
    parser decodes the parts, so the gateway would check one form and forward another."""
    if not content_type:
        raise UnsupportedMediaType("This endpoint takes multipart/form-data.")
    ctype, params = parse_options_header(content_type)
    boundary = params.get(b"boundary", b"")
    if ctype != b"multipart/form-data" or not _BOUNDARY.fullmatch(boundary):
        raise UnsupportedMediaType("This endpoint takes multipart/form-data with a boundary.")
    charset = params.get(b"charset", b"utf-8").lower()
    if set(params) - {b"boundary", b"charset"} or charset not in (b"utf-8", b"utf8"):
        raise UnsupportedMediaType(
            "The multipart Content-Type may carry only a boundary (and charset=utf-8)."
        )
    return boundary


def content_type(upload: Upload) -> bytes:
    """The Content-Type an upload is forwarded with, written by the gateway."""
    return b'multipart/form-data; boundary="' + upload.boundary + b'"'


class _Collector:
    """python-multipart callbacks that enforce the caps while the parser runs."""

    def __init__(self, settings: MediaSettings, max_file_bytes: int) -> None:
        self.settings = settings
        self.max_file_bytes = max_file_bytes
        self.parts: list[_Part] = []
        self._field = b""
        self._value = b""
        self._header_bytes = 0

    @property
    def current(self) -> _Part:
        return self.parts[-1]

    def on_part_begin(self) -> None:
        if len(self.parts) >= self.settings.upload_max_parts:
            raise InvalidRequest("The upload has more parts than this gateway accepts.")
        self.parts.append(_Part())
        self._header_bytes = 0

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]
        self._count(end - start)

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]
        self._count(end - start)

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > _MAX_HEADER_BYTES:
            raise InvalidRequest("A part of the upload has headers that are too large.")

    def on_header_end(self) -> None:
        if _CONTROL.search(self._value):
            # str.strip() would drop some of these (\x0b, \x1c, \x85...) where the
            # engine's parser keeps them: `name=model\x1c` would be `model` here only.
            raise InvalidRequest("A part of the upload has a header with control characters.")
        name = self._field.decode("latin-1").strip(" \t").lower()
        self.current.headers[name] = self._value.decode("latin-1").strip(" \t")
        self._field = self._value = b""

    def on_headers_finished(self) -> None:
        part = self.current
        disposition, params = parse_options_header(part.headers.get("content-disposition"))
        name = params.get(b"name")
        if disposition != b"form-data" or not name:
            raise InvalidRequest("Every part of the upload needs a form-data name.")
        part.name = name.decode("utf-8", "replace")
        filename = params.get(b"filename")
        part.filename = filename.decode("utf-8", "replace") if filename is not None else None

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self.current
        part.data += data[start:end]
        cap = self.max_file_bytes if part.name == "file" else self.settings.upload_max_field_bytes
        if len(part.data) > cap:
            if part.name == "file":
                raise MediaTooLarge("The uploaded file is larger than this gateway accepts.")
            raise InvalidRequest(f"The form field '{part.name[:64]}' is too large.")


def validate_upload(
    content_type: str | None, body: bytes, settings: MediaSettings, *, max_file_bytes: int
) -> Upload:
    boundary = _boundary(content_type)
    collector = _Collector(settings, max_file_bytes)
    callbacks = {
        "on_part_begin": collector.on_part_begin,
        "on_header_field": collector.on_header_field,
        "on_header_value": collector.on_header_value,
        "on_header_end": collector.on_header_end,
        "on_headers_finished": collector.on_headers_finished,
        "on_part_data": collector.on_part_data,
    }
    ended: list[bool] = []
    callbacks["on_end"] = lambda: ended.append(True)
    parser = MultipartParser(boundary, callbacks, max_size=len(body))  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError:
        raise InvalidRequest("The multipart body is malformed.") from None
    if not ended:
        raise InvalidRequest("The multipart body is truncated.")
    return _check(collector.parts, settings, boundary)


def _check(parts: list[_Part], settings: MediaSettings, boundary: bytes) -> Upload:
    fields: dict[str, list[str]] = {}
    files = [p for p in parts if p.name == "file"]
    for part in parts:
        if not _FIELD_NAME.fullmatch(part.name):
            raise InvalidRequest("A form field's name has characters this gateway refuses.")
        if part.name in FORBIDDEN_FORM_FIELDS:
            raise FieldNotAllowed(f"The field '{part.name}' is not allowed.", param=part.name)
        if part.name == "file":
            continue
        if part.filename is not None:
            raise InvalidRequest("Only the 'file' part may carry a file.", param=part.name)
        if part.name in fields and not part.name.endswith("[]"):
            raise InvalidRequest("A form field appears twice.", param=part.name[:64])
        try:
            fields.setdefault(part.name, []).append(part.data.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidRequest("A form field is not UTF-8 text.", param=part.name[:64]) from None
    if len(files) != 1 or files[0].filename is None:
        raise InvalidRequest("The upload needs exactly one 'file' part.", param="file")
    data = bytes(files[0].data)
    declared = files[0].headers.get("content-type", "").split(";")[0].strip().lower()
    if declared not in _UPLOAD_TYPES:
        # Clients label uploads application/octet-stream more often than not: name the
        # type from the magic bytes, then hold the bytes to the allowlist as usual.
        sniffed = sniff(data)
        declared = min(AUDIO_TYPES.get(sniffed or "", {""}))
    if not data:
        raise MediaInvalid("The uploaded file is empty.", param="file")
    info = validate_audio(data, declared, settings)
    return Upload(fields, boundary, info.seconds)


_UPLOAD_TYPES: frozenset[str] = frozenset().union(*AUDIO_TYPES.values())
