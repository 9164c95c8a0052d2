"""Multipart audio uploads: parsed with python-multipart under caps, forwarded only when
the single `file` part is an allowed audio container."""

from __future__ import annotations

import pytest

from gateway.errors import (
    FieldNotAllowed,
    GatewayError,
    InvalidRequest,
    MediaInvalid,
    MediaTooLarge,
    UnsupportedMediaType,
)
from gateway.media.settings import MediaSettings
from gateway.proxy.multipart import content_type, validate_upload
from tests.unit.media.test_samples import HTML, SVG, png, wav

BOUNDARY = "gwtestboundary"
CTYPE = f"multipart/form-data; boundary={BOUNDARY}"
SETTINGS = MediaSettings(upload_max_parts=6, upload_max_field_bytes=64)
MAX_FILE = 50_000


def form(*parts: tuple[str, bytes, str | None, str | None], end: bool = True) -> bytes:
    out = b""
    for name, data, filename, ctype in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n".encode()
        if ctype:
            out += f"Content-Type: {ctype}\r\n".encode()
        out += b"\r\n" + data + b"\r\n"
    if end:
        out += f"--{BOUNDARY}--\r\n".encode()
    return out


def audio(
    data: bytes | None = None, ctype: str | None = "audio/wav"
) -> tuple[str, bytes, str | None, str | None]:
    return ("file", wav() if data is None else data, "a.wav", ctype)


def test_a_valid_upload_is_accepted() -> None:
    body = form(audio(), ("model", b"whisper", None, None), ("language", b"en", None, None),
                ("timestamp_granularities[]", b"word", None, None),
                ("timestamp_granularities[]", b"segment", None, None))  # fmt: skip
    upload = validate_upload(CTYPE, body, SETTINGS, max_file_bytes=MAX_FILE)
    assert upload.fields["model"] == ["whisper"]
    assert upload.fields["timestamp_granularities[]"] == ["word", "segment"]


def test_octet_stream_uploads_are_named_by_their_magic_bytes() -> None:
    body = form(audio(ctype="application/octet-stream"))
    assert (
        validate_upload(CTYPE, body, SETTINGS, max_file_bytes=MAX_FILE).boundary
        == BOUNDARY.encode()
    )
    body = form(audio(ctype=None))
    assert (
        validate_upload(CTYPE, body, SETTINGS, max_file_bytes=MAX_FILE).boundary
        == BOUNDARY.encode()
    )


@pytest.mark.parametrize(
    ("ctype", "body", "error"),
    [
        ("application/json", b"{}", UnsupportedMediaType),
        (None, form(audio()), UnsupportedMediaType),
        ("multipart/form-data", form(audio()), UnsupportedMediaType),  # no boundary
        ("multipart/form-data; boundary=" + "b" * 71, form(audio()), UnsupportedMediaType),
        (CTYPE, form(("model", b"m", None, None)), InvalidRequest),  # no file
        (CTYPE, form(audio(), audio()), InvalidRequest),  # two files
        (CTYPE, form(("file", wav(), None, "audio/wav")), InvalidRequest),  # no filename
        (CTYPE, form(audio(), ("other", b"x", "b.wav", "audio/wav")), InvalidRequest),
        (CTYPE, form(audio(), ("model", b"a", None, None), ("model", b"b", None, None)),
         InvalidRequest),
        (CTYPE, form(audio(), ("model", b"x" * 65, None, None)), InvalidRequest),
        (CTYPE, form(audio(), ("model", b"\xff\xfe", None, None)), InvalidRequest),
        (CTYPE, form(audio(), *[(f"f{i}", b"x", None, None) for i in range(6)]), InvalidRequest),
        (CTYPE, form(audio(), end=False), InvalidRequest),  # truncated
        (CTYPE, b"garbage without boundaries", InvalidRequest),
        (CTYPE, f"--{BOUNDARY}\r\nX-Pad: {'a' * 5000}\r\n\r\nx\r\n--{BOUNDARY}--\r\n".encode(),
         InvalidRequest),
        (CTYPE, f"--{BOUNDARY}\r\nContent-Type: text/plain\r\n\r\nx\r\n--{BOUNDARY}--\r\n"
         .encode(), InvalidRequest),  # no Content-Disposition name
        (CTYPE, form(audio(), ("mm_processor_kwargs", b"{}", None, None)), FieldNotAllowed),
        (CTYPE, form(audio(), ("kv_transfer_params", b"{}", None, None)), FieldNotAllowed),
        (CTYPE, form(audio(), ("priority", b"-100", None, None)), FieldNotAllowed),
        (CTYPE, form(audio(), ("request_id", b"another-tenants-id", None, None)), FieldNotAllowed),
        (CTYPE, form(audio(), ("image_embeds", b"AAAA", None, None)), FieldNotAllowed),
        (CTYPE, form(audio(HTML, "audio/wav")), MediaInvalid),
        (CTYPE, form(audio(SVG, "application/octet-stream")), MediaInvalid),
        (CTYPE, form(audio(png(), "audio/wav")), MediaInvalid),
        (CTYPE, form(audio(b"", "audio/wav")), MediaInvalid),
        (CTYPE, form(audio(wav(30_000))), MediaTooLarge),
    ],
)  # fmt: skip
def test_bad_uploads_are_refused(ctype: str | None, body: bytes, error: type[GatewayError]) -> None:
    with pytest.raises(error) as info:
        validate_upload(ctype, body, SETTINGS, max_file_bytes=MAX_FILE)
    assert 400 <= info.value.status < 500


def test_the_model_field_is_exposed_for_the_model_check() -> None:
    with_model = form(audio(), ("model", b"whisper-large", None, None))
    assert validate_upload(CTYPE, with_model, SETTINGS, max_file_bytes=MAX_FILE).model == (
        "whisper-large"
    )
    without = validate_upload(CTYPE, form(audio()), SETTINGS, max_file_bytes=MAX_FILE)
    assert without.model is None
    empty = form(audio(), ("model", b"", None, None))
    assert validate_upload(CTYPE, empty, SETTINGS, max_file_bytes=MAX_FILE).model == ""
    # Two `model` fields could be read differently by the gateway and the engine.
    twice = form(audio(), ("model", b"a", None, None), ("model", b"b", None, None))
    with pytest.raises(InvalidRequest):
        validate_upload(CTYPE, twice, SETTINGS, max_file_bytes=MAX_FILE)


def test_vllm_xargs_form_field_is_refused() -> None:
    body = form(audio(), ("vllm_xargs", b'{"kv_transfer_params": {}}', None, None))
    with pytest.raises(FieldNotAllowed) as info:
        validate_upload(CTYPE, body, SETTINGS, max_file_bytes=MAX_FILE)
    assert info.value.param == "vllm_xargs"


@pytest.mark.parametrize(
    "content_type",
    [
        "multipart/form-data; boundary=B; charset=utf-7",
        "multipart/form-data; boundary=B; charset=utf-16",
        "multipart/form-data; boundary=B; foo=bar",
        'multipart/form-data; boundary="a\\"b"',
        "multipart/form-data; boundary=" + "x" * 71,
    ],
)
def test_only_a_boundary_and_utf8_are_accepted(content_type: str) -> None:
    with pytest.raises(UnsupportedMediaType):
        validate_upload(content_type, b"", MediaSettings(), max_file_bytes=1 << 20)


def test_an_upload_is_forwarded_under_a_content_type_the_gateway_writes() -> None:
    upload = validate_upload(
        CTYPE + "; charset=UTF-8", form(audio()), MediaSettings(), max_file_bytes=1 << 20
    )
    assert content_type(upload) == f'multipart/form-data; boundary="{BOUNDARY}"'.encode()


@pytest.mark.parametrize(
    "disposition",
    [
        b"form-data; name=model\x1c",  # str.strip() dropped \x1c; Starlette keeps it
        b'form-data; name="model"\x85',
        b"form-data; name=model\x0b",
        b'form-data; name="model"\xa0',
        b'form-data; name="x"; filename\x1c',
    ],
)
def test_part_headers_with_control_characters_are_refused(disposition: bytes) -> None:
    """The engine's form parser would read another name than the gateway checked."""
    body = form(audio()).replace(
        b"--" + BOUNDARY.encode() + b"--",
        b"--" + BOUNDARY.encode() + b"\r\nContent-Disposition: " + disposition
        + b"\r\n\r\nvalue\r\n--" + BOUNDARY.encode() + b"--",
    )  # fmt: skip
    with pytest.raises(InvalidRequest, match="control characters"):
        validate_upload(CTYPE, body, MediaSettings(), max_file_bytes=1 << 20)
