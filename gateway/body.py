"""Reading request bodies from ASGI `receive` under a size cap.

The cap is enforced while reading, so a body sent without `Content-Length` (chunked) is
cut off at the cap instead of being buffered whole first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.errors import RequestTooLarge

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class ClientDisconnected(Exception):
    """The client went away before its request body was complete."""


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The Content-Length header's value, None when absent or malformed."""
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The request body is larger than this gateway accepts ({limit} bytes).")


def check_declared(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    """Refuse at once when the declared length is over the cap, before reading."""
    length = declared_length(headers)
    if length is not None and length > limit:
        raise _too_large(limit)


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole body, or RequestTooLarge as soon as more than `limit` bytes arrived."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)
