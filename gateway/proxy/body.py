"""Reading a request's body as its route declares it, under a size cap.

    incoming = await read_incoming(scope, receive, ex, settings, guard, charge)

A JSON body is read whole and parsed once into an object; a multipart upload is read
whole and validated (gateway/proxy/multipart.py); other routes take no body. What the
body holds is charged to the request's `Charge` (gateway/proxy/budget.py) from its first
byte: each chunk as it arrives, the parsed object as soon as it is made
(gateway/proxy/footprint.py). The cap is enforced while reading, so a body sent without
`Content-Length` (chunked) is cut off at the cap instead of being buffered whole first,
and so is the pace (`BodyPace`, gateway/server/limits.py): a body that stalls or
trickles is cut with 408 before it reaches an engine. The app's `ConnectionGuard`,
whose sweep keeps the pace, is handed in by the proxy.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import orjson

from gateway.access.endpoints import BodyKind
from gateway.config.settings import Settings
from gateway.errors import InvalidJson, RequestTimeout, RequestTooLarge, UnsupportedMediaType
from gateway.exchange import Exchange
from gateway.proxy.budget import Charge
from gateway.proxy.footprint import held_by
from gateway.proxy.multipart import Upload, content_type, validate_upload
from gateway.server.limits import BodyPace, ConnectionGuard
from gateway.types import Receive, Scope

# The Content-Type a JSON request is forwarded with: the media type that was checked,
# never the client's header, which can change after the check (a `Connection:
# content-type` makes it hop-by-hop: docs/facts.md, "Headers").
_JSON_CONTENT_TYPE = (b"content-type", b"application/json")


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


def _too_slow(pace: BodyPace, received: int) -> RequestTimeout:
    if pace.due(received) < pace.deadline:
        return RequestTimeout(
            f"The request body arrived slower than this gateway accepts "
            f"({pace.rate:.0f} bytes a second on average after the first {pace.grace:g} s)."
        )
    return RequestTimeout(f"The request body did not arrive within {pace.deadline:g} s.")


async def read_body(
    receive: Receive, limit: int, guard: ConnectionGuard, charge: Charge | None = None
) -> bytes:
    """The whole body; RequestTooLarge as soon as more than `limit` bytes arrived,
    RequestTimeout once it falls behind the guard's `body_pace`; each chunk is charged to
    `charge` as it arrives (its refusals: gateway/proxy/budget.py), and stays charged
    when the body is complete: the caller gives it back when it drops the bytes. 40
    bodies of 32 MiB held a byte short of their end kept 1.3 GiB for a minute.

    The pace is kept by the guard's sweep (gateway/server/limits.py), not by a timer: the
    body's due time is a dict entry, moved as each chunk arrives; a body late by it is
    cancelled by the sweep, within its interval."""
    loop = guard.running_loop()
    task = asyncio.current_task(loop)
    assert task is not None
    pace = guard.body_pace
    bodies = guard.bodies
    start = loop.time()
    bodies[task] = start + pace.due(0)
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk: bytes = message.get("body", b"")
            more = message.get("more_body", False)
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                if charge is not None:
                    charge.take(len(chunk))
                chunks.append(chunk)
                if more:
                    bodies[task] = start + pace.due(size)
            if not more:
                break
    except asyncio.CancelledError:
        if task not in guard.late:
            raise
        guard.late.discard(task)
        task.uncancel()
        raise _too_slow(pace, size) from None
    finally:
        bodies.pop(task, None)
    if len(chunks) == 1:
        return chunks[0]
    # While joined, the chunks and the whole are held at once: charged twice meanwhile.
    if charge is not None:
        charge.take(size)
    try:
        return b"".join(chunks)
    finally:
        del chunks
        if charge is not None:
            charge.give(size)


class Incoming:
    """A request's body as read: the bytes to forward, the parsed JSON object or the
    validated upload, the Content-Type header to forward with them, and the `Charge`
    for what it holds. Its holder drops each part as soon as it is not needed
    (`drop_json`, `replace_data`, `take_data`) and the charge goes down with it."""

    __slots__ = ("charge", "content_type", "data", "json", "json_size", "size", "upload")

    def __init__(
        self,
        data: bytes | None = None,
        json: dict[str, Any] | None = None,
        upload: Upload | None = None,
        content_type: tuple[bytes, bytes] | None = None,
        *,
        charge: Charge | None = None,
        json_size: int = 0,
    ) -> None:
        self.data = data
        self.json = json
        self.upload = upload
        self.content_type = content_type
        self.charge = charge
        # What the parsed object was charged (gateway/proxy/footprint.py).
        self.json_size = json_size
        # The body's size as the client sent it.
        self.size = len(data) if data is not None else 0

    def drop_json(self) -> None:
        """The parsed object is no longer needed: dropped, its charge given back."""
        self.json = None
        if self.charge is not None:
            self.charge.give(self.json_size)
        self.json_size = 0

    def replace_data(self, data: bytes) -> None:
        """Forward `data` (the body rewritten from the parsed object) instead of the bytes
        the client sent, which are dropped. What the rewrite added (inlined media) is in
        the parsed object too until `drop_json`: charged to it. Raises the budget's
        refusals (nothing changed then)."""
        old = self.data
        grown = max(0, len(data) - (len(old) if old is not None else 0))
        charge = self.charge
        if charge is not None:
            charge.take(len(data) + grown)
            self.json_size += grown
        self.data = data
        if charge is not None and old is not None:
            charge.give(len(old))

    def drop(self) -> None:
        """Everything it holds dropped, its charge given back: the request is over (or
        the engine has the body)."""
        self.json = None
        self.data = None
        self.json_size = 0
        if self.charge is not None:
            self.charge.close()

    def take_data(self) -> bytes | None:
        """The bytes to forward, handed over: this object keeps no reference to them.
        Their charge stays until the request's charge is closed (the engine has them)."""
        data = self.data
        self.data = None
        return data


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header (`name` in lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    # The usual spelling first: no method calls (each ~0.5-1K instructions, callgrind).
    if content_type == b"application/json":
        return True
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"


# Bodies up to this size are parsed without counting their values: the densest of them
# (arrays nested 500 deep) parse into ~160 MiB, in ~0.2 s.
COUNT_VALUES_OVER = 4 * 1024 * 1024
# Bodies over this size are parsed with the cyclic collector paused.
PAUSE_COLLECTOR_OVER = 64 * 1024
# Bytes that open a value, but for the body's first: an array's first element follows
# `[`, every other element and object member follows `,`, an object's first member `{`.
_VALUE_OPENERS = b",[{"


def parse_json(raw: bytes, max_values: int) -> Any:
    """`raw` parsed; InvalidJson, or RequestTooLarge for a large body with more than
    `max_values` values.

    The count is an upper bound (the bytes count inside strings too) taken in one pass
    (1.3 ms a MiB), only over `COUNT_VALUES_OVER`: an image's body is mostly base64,
    which has none of them. A body over `PAUSE_COLLECTOR_OVER` is parsed with the cyclic
    collector paused: the containers a dense one makes each count towards a collection,
    and collections walked them again and again (32 MiB of `[],`: 7.6 s, 1.1 s paused;
    4 MiB: 1.0 s, 0.1 s paused).
    """
    if len(raw) > COUNT_VALUES_OVER:
        values = len(raw) - len(raw.translate(None, _VALUE_OPENERS))
        if values > max_values:
            raise RequestTooLarge(
                f"The request body has more JSON values than this gateway accepts ({max_values})."
            )
    paused = len(raw) > PAUSE_COLLECTOR_OVER and gc.isenabled()
    if paused:
        gc.disable()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidJson("The request body is not valid JSON.") from None
    finally:
        if paused:
            gc.enable()


async def read_incoming(
    scope: Scope,
    receive: Receive,
    ex: Exchange,
    settings: Settings,
    guard: ConnectionGuard,
    charge: Charge,
) -> Incoming:
    """The request's body as `ex.route` declares it, held to `guard`'s pace, what it
    holds charged to `charge` (the caller closes it). Raises UnsupportedMediaType,
    RequestTooLarge, RequestTimeout, InvalidJson, ClientDisconnected, the budget's and
    the upload's refusals."""
    route = ex.route
    limits = settings.limits
    if route.body is BodyKind.json:
        if not _is_json(header(scope, b"content-type")):
            raise UnsupportedMediaType("This endpoint takes 'Content-Type: application/json'.")
        check_declared(scope["headers"], limits.max_body_bytes)
        raw = await read_body(receive, limits.max_body_bytes, guard, charge)
        loaded = parse_json(raw, limits.max_json_values)
        if not isinstance(loaded, dict):
            raise InvalidJson("The request body must be a JSON object.")
        # Charged as soon as it is made, before any other request can be admitted (no
        # await between): one parse at a time may exceed the budget, for as long as
        # this takes, by what it holds (~180 MiB at most: max_json_values).
        json_size = held_by(loaded, raw)
        charge.take(json_size)
        return Incoming(raw, loaded, None, _JSON_CONTENT_TYPE, charge=charge, json_size=json_size)
    if route.body is BodyKind.multipart:
        # Read whole (capped) and validated before anything reaches an engine: the
        # upload is forwarded only when it is one well-formed audio file.
        check_declared(scope["headers"], limits.max_upload_bytes)
        raw = await read_body(receive, limits.max_upload_bytes, guard, charge)
        declared = header(scope, b"content-type")
        upload = validate_upload(
            None if declared is None else declared.decode("latin-1"),
            raw,
            settings.media,
            max_file_bytes=limits.max_upload_bytes,
        )
        # Written by the gateway with the boundary the body was parsed with.
        return Incoming(raw, None, upload, (b"content-type", content_type(upload)), charge=charge)
    return Incoming()
