"""The one place the gateway renders its own answers: every `GatewayError` (as an ASGI
response, a raw HTTP/1.1 response for the connection protocol, or a mid-stream SSE
frame), and the JSON bodies it answers itself.

An error's body is OpenAI's error object; its `message` is the gateway's own text,
never a library's (gateway/errors.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

import orjson

from gateway.errors import GatewayError
from gateway.types import Send


def error_payload(exc: GatewayError) -> dict[str, dict[str, str | None]]:
    """The OpenAI-style error object for `exc`."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def error_body(exc: GatewayError) -> bytes:
    return orjson.dumps(error_payload(exc))


def sse_error_frame(exc: GatewayError) -> bytes:
    """A mid-stream error, framed the way vLLM frames one."""
    return b"data: " + error_body(exc) + b"\n\n"


def raw_response(exc: GatewayError) -> bytes:
    """`exc` as a whole HTTP/1.1 response that closes the connection, for the connection
    protocol (gateway/server/protocol.py), which answers before there is an ASGI request."""
    body = error_body(exc)
    head = [f"HTTP/1.1 {exc.status} {HTTPStatus(exc.status).phrase}"]
    head += ["content-type: application/json", f"content-length: {len(body)}"]
    head += [f"{name.lower()}: {value}" for name, value in exc.headers.items()]
    head += ["connection: close", "", ""]
    return "\r\n".join(head).encode("latin-1") + body


async def send_json(
    send: Send, status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> None:
    """`body`, already JSON, as a complete ASGI HTTP response with `status`."""
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
    ]
    for name, value in (headers or {}).items():
        raw_headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, exc: GatewayError, headers: Mapping[str, str] | None = None
) -> None:
    """Render `exc` as a complete ASGI HTTP response."""
    await send_json(send, exc.status, error_body(exc), {**exc.headers, **(headers or {})})
