"""The live client: sessions replayed through front ends over HTTP, with the time to
first token per call and the engines' load sampled while they run."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.suites.routing.workloads import Call, follow


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    # Per engine, the sum of its `/load` (requests in flight) over the samples taken.
    busy: list[float] = field(default_factory=list)
    # (X-Request-Id, call key) of every call, in the order sent (with a `tag`).
    calls: list[tuple[str, str | None]] = field(default_factory=list)
    # X-Request-Id -> the prompt tokens the engine found cached, from the stream's usage
    # (`stream_options.include_usage`, the engine's `--enable-prompt-tokens-details`).
    cached: dict[str, int] = field(default_factory=dict)
    # X-Request-Id -> its time to first chunk, seconds (calls sent with a `tag`).
    ttft_by_id: dict[str, float] = field(default_factory=dict)
    # X-Request-Id -> (sent, answered whole), seconds on the client's clock (calls sent
    # with a `tag`): which calls shared an engine at a moment.
    span_by_id: dict[str, tuple[float, float]] = field(default_factory=dict)


async def _send(
    http: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: bytes,
    out: Outcome,
    want_reply: bool = False,
) -> str:
    """POST a streamed call; records its time to first chunk, and the cached prompt
    tokens its usage reports. Returns the reply's text when `want_reply` (a chat client
    sends it back with the next turn), else ""."""
    start = time.perf_counter()
    chunks: list[bytes] = []
    tail = b""
    try:
        async with http.post(url, data=body, headers=headers) as resp:
            first: float | None = None
            async for chunk in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter() - start
                if want_reply:
                    chunks.append(chunk)
                # The usage chunk comes last, before `data: [DONE]`.
                tail = (tail + chunk)[-_USAGE_TAIL:]
            if resp.status != 200:
                out.errors += 1
                out.first_error = out.first_error or f"HTTP {resp.status} from {url}"
                return ""
            request_id = headers.get("X-Request-Id")
            if first is not None:
                out.ttft.append(first)
                if request_id is not None:
                    out.ttft_by_id[request_id] = first
            cached = _cached_tokens(tail)
            if request_id is not None:
                out.span_by_id[request_id] = (start, time.perf_counter())
                if cached is not None:
                    out.cached[request_id] = cached
    except aiohttp.ClientError as exc:
        out.errors += 1
        out.first_error = out.first_error or f"{type(exc).__name__} from {url}"
        return ""
    return _reply_text(b"".join(chunks)) if want_reply else ""


_USAGE_TAIL = 4096


def _cached_tokens(tail: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of the last usage event in `tail`."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = orjson.loads(line[6:]).get("usage") or {}
            except orjson.JSONDecodeError:
                return None
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            return int(cached) if isinstance(cached, int) else None
    return None


def _reply_text(events: bytes) -> str:
    """The assistant's text in a chat completion's SSE stream."""
    parts = []
    for line in events.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices", ()):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


async def _sample_load(
    http: aiohttp.ClientSession, engines: Sequence[str], out: Outcome, stop: asyncio.Event
) -> None:
    """Poll each engine's `/load` (vLLM's requests-in-flight figure) every 50 ms."""
    out.busy = [0.0] * len(engines)
    while not stop.is_set():
        for i, engine in enumerate(engines):
            try:
                async with http.get(engine + "/load") as resp:
                    out.busy[i] += float((await resp.json())["server_load"])
            except (aiohttp.ClientError, KeyError, ValueError):
                pass
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


@dataclass
class _Open:
    """A session in progress: its calls, the next one, the last body sent and the
    engine's reply to it."""

    calls: list[Call]
    next: int = 0
    previous: dict[str, Any] | None = None
    reply: str = ""


async def replay(
    sessions: Sequence[Sequence[Call]],
    fronts: Sequence[str],
    headers: dict[str, str],
    concurrency: int,
    live: int,
    engines: Sequence[str] = (),
    tag: str = "",
) -> Outcome:
    """Run the sessions with `live` of them open at once and `concurrency` requests in
    flight; calls alternate over `fronts`.

    An open session whose call has been answered goes to the back of a queue: while it
    waits there, its user is reading and typing, and other sessions' turns run. So with
    `live` above `concurrency`, as in production, an engine holds many conversations
    between their turns, not only the ones being answered.

    With a `tag`, each call carries `X-Request-Id: <tag><n>`, recorded with its key in
    `Outcome.calls`, so the engines' request recorders tell where each call went."""
    out = Outcome()
    pending = iter(sessions)
    ready: asyncio.Queue[_Open | None] = asyncio.Queue()
    open_sessions = 0
    turn = itertools.count()
    numbers = itertools.count()
    base = {"Content-Type": "application/json", **headers}

    def open_next() -> None:
        nonlocal open_sessions
        session = next(pending, None)
        if session is not None:
            open_sessions += 1
            ready.put_nowait(_Open(list(session)))

    async def user(http: aiohttp.ClientSession) -> None:
        nonlocal open_sessions
        while (session := await ready.get()) is not None:
            if session.next >= len(session.calls):
                open_sessions -= 1
                open_next()
                if open_sessions == 0:
                    ready.put_nowait(None)
                continue
            call = session.calls[session.next]
            session.next += 1
            body = follow(call, session.previous, session.reply)
            follows = session.next < len(session.calls) and session.calls[session.next].follow_up
            front = fronts[next(turn) % len(fronts)]
            url = front + call.path
            sent = base
            if tag:
                request_id = f"{tag}{next(numbers)}"
                out.calls.append((request_id, call.key))
                sent = {**base, "X-Request-Id": request_id}
            session.reply = await _send(http, url, sent, orjson.dumps(body), out, follows)
            session.previous = body
            ready.put_nowait(session)
        ready.put_nowait(None)  # wake the next user, so every user ends

    for _ in range(max(1, live)):
        open_next()
    if open_sessions == 0:
        return out
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        sampler = asyncio.create_task(_sample_load(http, engines, out, stop))
        await asyncio.gather(*(user(http) for _ in range(concurrency)))
        stop.set()
        await sampler
    return out
