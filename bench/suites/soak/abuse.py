"""The soak's abuse, in its own process: `python -m bench.suites.soak.abuse CONFIG.json`.

It builds its payloads, prints `ready`, waits for `go` on stdin, abuses the gateway for
`duration` seconds, closes every connection it holds and prints its tally as one JSON
line. Two families:

- held connections (slowloris head dribbling, idle, slow bodies): each is kept open
  until the gateway answers or closes it, then opened again after a short pause, so the
  pressure stays constant; the tally records how each ended and after how long;
- requests (oversized bodies and media, decode-heavy images, bad JSON): `workers`
  loops each send one request per `interval` on a fresh connection and record the
  status line, or that the gateway closed the connection without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import resource
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.suites.report import spread
from bench.suites.soak.payloads import (
    CHAT,
    HeavyPng,
    bad_json_bodies,
    data_url,
    images_chat,
    oversized_media_chat,
    pixel_bomb_chat,
)

# Pause before a held connection that ended is opened again.
REOPEN_PAUSE = 0.5
# Bytes of a slow body's declared Content-Length: never reached at one byte a drip.
SLOW_BODY_LENGTH = 100_000
# The kinds SIGUSR1 stops (SIGUSR2 stops all): what costs the gateway memory.
HEAVY = ("decode-heavy media", "oversized media, bytes", "oversized body, chunked")


@dataclass
class AbuseConfig:
    host: str
    port: int
    # Abuse keys by role: "slow" (slow bodies), "media" (oversized and decode-heavy
    # media), "misc" (oversized bodies, bad JSON). Separate keys, so that a per-key cap
    # filled by one kind does not shield the gateway from the others.
    keys: dict[str, str]
    model: str
    duration: float
    # What the gateway's defaults are (read by the suite from gateway.config.settings).
    max_in_flight: int
    max_body_bytes: int
    media_max_bytes: int
    max_pixels: int
    head_dribblers: int = 200
    dribble_interval: float = 5.0
    idle: int = 100
    slow_bodies: int = 0  # 0: max_in_flight, enough to hold every slot today
    drip_interval: float = 2.0
    decode_workers: int = 2
    images_per_request: int = 8
    answer_timeout: float = 30.0
    # Seconds over which the held connections are opened at the start.
    ramp: float = 2.0
    # Kinds left out (names as in the tally), for experiments.
    skip: list[str] = field(default_factory=list)


@dataclass
class Tally:
    """How one kind of abuse went: attempts and how each ended."""

    what: str
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    # Seconds until the gateway answered or closed (held connections: time held).
    ended_after: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "sent": self.sent,
            "outcomes": dict(self.outcomes),
            "gateway_ended": sum(
                n for k, n in self.outcomes.items() if k.startswith(("status", "closed"))
            ),
            "ended_after_s": spread(self.ended_after),
        }


def _status(data: bytes) -> str:
    """'status 413' from a response's first bytes, else 'garbage'."""
    line = data.split(b"\r\n", 1)[0].split()
    return f"status {int(line[1])}" if len(line) >= 2 and line[1].isdigit() else "garbage"


async def _first_bytes(reader: asyncio.StreamReader) -> bytes:
    """The response's first bytes (b'' when the gateway closed without any)."""
    try:
        return await reader.read(65536)
    except (ConnectionError, OSError):
        return b""


class Abuse:
    def __init__(self, cfg: AbuseConfig) -> None:
        self.cfg = cfg
        self.stop = asyncio.Event()
        self.stop_heavy = asyncio.Event()
        self.heavy_stopped_after: float | None = None
        self.tallies: dict[str, Tally] = {}
        self.host_line = f"Host: {cfg.host}:{cfg.port}\r\n"
        heavy = HeavyPng(cfg.max_pixels)
        self.heavy = heavy
        self.nonce = itertools.count()
        self.bad_json = itertools.cycle(bad_json_bodies(cfg.model))
        self.bomb = pixel_bomb_chat(cfg.model)
        self.oversized_media = oversized_media_chat(cfg.model, cfg.media_max_bytes)
        self.heavy_pixels = heavy.pixels

    def tally(self, kind: str, what: str) -> Tally:
        return self.tallies.setdefault(kind, Tally(what))

    def head(self, path: str, extra: str = "", role: str | None = "misc") -> bytes:
        """A request head with the key of `role` (None: no key)."""
        auth = "" if role is None else f"Authorization: Bearer {self.cfg.keys[role]}\r\n"
        return f"POST {path} HTTP/1.1\r\n{self.host_line}{auth}{extra}".encode()

    # --- held connections ---------------------------------------------------------------

    async def hold(
        self, kind: str, what: str, opening: bytes, drip: Callable[[int], bytes], every: float
    ) -> None:
        """One connection at a time, held open: `opening`, then `drip(n)` every `every`
        seconds (none when `every` is 0), until the gateway ends it; then again."""
        t = self.tally(kind, what)
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(self.cfg.host, self.cfg.port)
            except OSError:
                t.outcomes["connect failed"] += 1
                await self._pause(REOPEN_PAUSE)
                continue
            t.sent += 1
            started = time.monotonic()
            answer = asyncio.ensure_future(_first_bytes(reader))
            stopped = asyncio.ensure_future(self.stop.wait())
            try:
                writer.write(opening)
                n = 0
                while not answer.done() and not self.stop.is_set():
                    timeout = every if every > 0 else None
                    await asyncio.wait(
                        {answer, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                    if every > 0 and not answer.done() and not self.stop.is_set():
                        n += 1
                        writer.write(drip(n))
                        await writer.drain()
            except (ConnectionError, OSError):
                pass
            if not answer.done():
                # A write failed (reset) or the phase ended: see if an answer came.
                grace = 0.05 if self.stop.is_set() else 1.0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(answer), grace)
            if answer.done():
                data = answer.result()
                t.outcomes[_status(data) if data else "closed by gateway"] += 1
                t.ended_after.append(time.monotonic() - started)
            else:
                t.outcomes["open at end"] += 1
                answer.cancel()
            stopped.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            await self._pause(REOPEN_PAUSE)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    def held(self) -> list[Awaitable[None]]:
        cfg = self.cfg
        jobs: list[tuple[str, str, bytes, Callable[[int], bytes], float]] = []
        dribble = self.head(CHAT, role=None)
        for _ in range(cfg.head_dribblers):
            jobs.append(
                (
                    "slowloris head",
                    f"no key; a header line every {cfg.dribble_interval:g} s",
                    dribble,
                    lambda n: f"X-Soak-{n}: {'a' * 16}\r\n".encode(),
                    cfg.dribble_interval,
                )
            )
        for _ in range(cfg.idle):
            jobs.append(
                ("idle connection", "no key; connects and sends nothing", b"", lambda n: b"", 0.0)
            )
        slow = self.head(
            CHAT,
            f"Content-Type: application/json\r\nContent-Length: {SLOW_BODY_LENGTH}\r\n\r\n{{",
            role="slow",
        )
        count = cfg.slow_bodies or cfg.max_in_flight
        for _ in range(count):
            jobs.append(
                (
                    "slow body",
                    f"key abuser-slow; headers and 1 byte, then a byte every "
                    f"{cfg.drip_interval:g} s ({count} at once)",
                    slow,
                    lambda n: b" ",
                    cfg.drip_interval,
                )
            )
        jobs = [job for job in jobs if job[0] not in cfg.skip]
        step = cfg.ramp / max(1, len(jobs))
        return [self._later(i * step, self.hold(*job)) for i, job in enumerate(jobs)]

    async def _later(self, delay: float, job: Awaitable[None]) -> None:
        await self._pause(delay)
        if not self.stop.is_set():
            await job
        elif asyncio.iscoroutine(job):
            job.close()

    # --- requests -----------------------------------------------------------------------

    async def request(self, t: Tally, opening: bytes, body: Iterable[bytes]) -> None:
        """One request on a fresh connection: `opening`, then `body` (a generator, made as
        it is sent). Records the status line, or how it ended without one."""
        try:
            reader, writer = await asyncio.open_connection(self.cfg.host, self.cfg.port)
        except OSError:
            t.outcomes["connect failed"] += 1
            return
        t.sent += 1
        started = time.monotonic()
        answer = asyncio.ensure_future(_first_bytes(reader))

        async def send() -> None:
            # Stopped when the answer comes: a gateway that refuses at the head (413)
            # need not read the rest, and a drain would then wait forever.
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(opening)
                for chunk in body:
                    writer.write(chunk)
                    await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            data = await asyncio.wait_for(asyncio.shield(answer), self.cfg.answer_timeout)
            t.outcomes[_status(data) if data else "closed by gateway"] += 1
            t.ended_after.append(time.monotonic() - started)
        except TimeoutError:
            t.outcomes["no answer in time"] += 1
        except asyncio.CancelledError:
            t.outcomes["unfinished at end"] += 1
            raise
        finally:
            sender.cancel()
            answer.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def json_request(
        self, body: bytes, content_type: bytes = b"application/json", role: str = "misc"
    ) -> bytes:
        extra = f"Content-Type: {content_type.decode()}\r\nContent-Length: {len(body)}\r\n"
        return self.head(CHAT, extra + "Connection: close\r\n\r\n", role) + body

    async def loop(
        self, kind: str, what: str, interval: float, make: Callable[[Tally], Awaitable[None]]
    ) -> None:
        t = self.tally(kind, what)
        while not self.stop.is_set() and not (kind in HEAVY and self.stop_heavy.is_set()):
            started = time.monotonic()
            await make(t)
            await self._pause(interval - (time.monotonic() - started))

    def requests(self) -> list[Awaitable[None]]:
        cfg = self.cfg
        mib = 2**20
        chunk = b"\x00" * mib

        def bad_json(t: Tally) -> Awaitable[None]:
            ctype, body = next(self.bad_json)
            return self.request(t, self.json_request(body, ctype), ())

        def declared(t: Tally) -> Awaitable[None]:
            length = cfg.max_body_bytes + 1
            head = self.head(
                CHAT,
                f"Content-Type: application/json\r\n"
                f"Content-Length: {length}\r\nConnection: close\r\n\r\n",
            )
            sizes = [mib] * (length // mib) + [length % mib]
            return self.request(t, head, (chunk[:n] for n in sizes))

        def chunked(t: Tally) -> Awaitable[None]:
            head = self.head(
                CHAT,
                "Content-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
            )
            frame = f"{mib:x}\r\n".encode() + chunk + b"\r\n"
            count = cfg.max_body_bytes // mib + 2
            frames = itertools.chain(itertools.repeat(frame, count), [b"0\r\n\r\n"])
            return self.request(t, head, frames)

        def media_bytes(t: Tally) -> Awaitable[None]:
            return self.request(t, self.json_request(self.oversized_media, role="media"), ())

        def media_pixels(t: Tally) -> Awaitable[None]:
            return self.request(t, self.json_request(self.bomb, role="media"), ())

        def heavy(t: Tally) -> Awaitable[None]:
            urls = [
                data_url("image/png", self.heavy.copy(next(self.nonce)))
                for _ in range(cfg.images_per_request)
            ]
            body = images_chat(cfg.model, urls)
            return self.request(t, self.json_request(body, role="media"), ())

        mp = self.heavy_pixels / 1e6
        specs: list[tuple[str, str, int, float, Callable[[Tally], Awaitable[None]]]] = [
            (
                "bad JSON",
                "key abuser-misc; 8 kinds of malformed body, 4 loops, 5/s each",
                4,
                0.2,
                bad_json,
            ),
            (
                "oversized body, declared",
                f"key abuser-misc; Content-Length {cfg.max_body_bytes + 1} "
                "(limits.max_body_bytes + 1), body sent until refused; 1/s",
                1,
                1.0,
                declared,
            ),
            (
                "oversized body, chunked",
                "key abuser-misc; no Content-Length, 1 MiB chunks past "
                "limits.max_body_bytes; 1 every 2 s",
                1,
                2.0,
                chunked,
            ),
            (
                "oversized media, bytes",
                f"key abuser-media; a data: image of media.max_bytes + 1 "
                f"({cfg.media_max_bytes + 1} bytes); 1 every 2 s",
                1,
                2.0,
                media_bytes,
            ),
            (
                "oversized media, pixels",
                "key abuser-media; a PNG header claiming 100,000 x 100,000; 2/s",
                1,
                0.5,
                media_pixels,
            ),
            (
                "decode-heavy media",
                f"key abuser-media; {cfg.images_per_request} PNGs of {mp:.1f} MP RGBA "
                f"(~{len(self.heavy.copy(0)) // 1024} KB each, cut short of their last rows) "
                f"per request, {cfg.decode_workers} at a time",
                cfg.decode_workers,
                0.0,
                heavy,
            ),
        ]
        jobs: list[Awaitable[None]] = []
        for kind, what, workers, interval, make in specs:
            if kind in cfg.skip:
                continue
            for _ in range(workers):
                jobs.append(self.loop(kind, what, interval, make))
        return jobs

    async def run(self) -> dict[str, Any]:
        # The suite's guard against a runaway gateway: SIGUSR1 stops the kinds that cost
        # memory, SIGUSR2 all of them.
        started = time.monotonic()

        def stop_heavy() -> None:
            self.stop_heavy.set()
            self.heavy_stopped_after = round(time.monotonic() - started, 2)

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, stop_heavy)
        loop.add_signal_handler(signal.SIGUSR2, self.stop.set)
        tasks = [asyncio.ensure_future(j) for j in [*self.held(), *self.requests()]]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), self.cfg.duration)
        ran = time.monotonic() - started
        self.stop.set()
        # Held connections notice the stop at once; requests in flight get a moment.
        done, pending = await asyncio.wait(tasks, timeout=2.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        errors = [repr(t.exception()) for t in done if not t.cancelled() and t.exception()]
        return {
            "config": asdict(self.cfg),
            "ran_s": round(ran, 2),
            "heavy_stopped_after_s": self.heavy_stopped_after,
            "kinds": {k: t.as_dict() for k, t in self.tallies.items()},
            "errors": errors[:10],
        }


def main(argv: list[str]) -> int:
    cfg = AbuseConfig(**json.loads(Path(argv[0]).read_text()))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    abuse = Abuse(cfg)  # builds the payloads (a few seconds)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    result = asyncio.run(abuse.run())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
