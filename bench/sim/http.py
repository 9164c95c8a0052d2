"""The few ASGI pieces the simulator needs: a buffered request and response senders.

The simulator is a plain ASGI app because the overhead benchmark compares the gateway
against direct calls to it: FastAPI routing costs ~200-270 us of CPU per request
(docs/facts.md), which would make the engine, not the gateway, the bottleneck.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

from bench.sim.errors import SimError, invalid_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"
SSE = b"text/event-stream; charset=utf-8"


class ClientGone(Exception):
    """The client disconnected before the whole body arrived."""


@dataclass
class Request:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    receive: Receive
    send: Send

    def header(self, name: bytes) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None

    def json(self) -> dict[str, Any]:
        """The body as a JSON object, checked the way vLLM's JSON routes check it."""
        # vLLM's validate_json_request: anything but application/json is 415.
        media_type = (self.header(b"content-type") or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise SimError(415, "Unsupported Media Type: Only 'application/json' is allowed")
        # Python's json, as vLLM's FastAPI reads a body: it takes what orjson refuses (a
        # BOM, UTF-16 and -32, lone surrogates, NaN, Infinity, 1e400) and reads integers
        # past 64 bits as integers, so a test of the gateway against parser differences
        # meets the engine's reading, not the gateway's own. (3 us more than orjson on a
        # small chat, 0.45 ms on a 1.3 MB body: direct and proxied alike.)
        try:
            data = json.loads(self.body)
        except ValueError:
            raise invalid_body("JSON decode error: the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise invalid_body("Input should be a valid dictionary or object")
        return data


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise SimError(413, "Request body too large")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes | None = JSON,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    raw = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        raw.append((b"content-type", content_type))
    raw.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, data: Any, status: int = 200) -> None:
    await respond(send, status, orjson.dumps(data))


async def start_stream(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", SSE), (b"cache-control", b"no-cache")],
        }
    )


async def send_event(send: Send, data: Any) -> None:
    await send(
        {
            "type": "http.response.body",
            "body": b"data: " + orjson.dumps(data) + b"\n\n",
            "more_body": True,
        }
    )


async def end_stream(send: Send) -> None:
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away. Call only after the body has been read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
