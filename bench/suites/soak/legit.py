"""The soak's legitimate traffic: an open-loop mix from a couple of keys.

Requests start on a fixed schedule (`rate` a second) whatever happened to the ones
before, so a slow or refusing gateway shows as latency and errors instead of as fewer
requests sent; latency runs from the scheduled start, so a client waiting for a free
connection counts too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from bench.suites.soak.payloads import legit_body, legit_kinds


@dataclass
class Outcome:
    """One legitimate request: when it was due, what it was, how it ended."""

    due: float  # seconds since the run's start
    kind: str
    key: str
    phase: str
    latency: float | None = None  # seconds from `due` to the last byte (None: no answer)
    status: int | None = None
    error: str | None = None  # "timeout", "connection", "stream cut", or None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and 200 <= self.status < 300

    def as_row(self) -> list[object]:
        latency = None if self.latency is None else round(self.latency * 1000, 2)
        return [
            round(self.due, 3),
            self.kind,
            self.key,
            self.phase,
            latency,
            self.status,
            self.error,
        ]


class LegitTraffic:
    """Sends the mix to `url` at `rate` requests a second, alternating `keys`."""

    def __init__(
        self,
        url: str,
        keys: dict[str, str],
        model: str,
        rate: float,
        timeout: float,
    ) -> None:
        self.url, self.rate, self.timeout = url, rate, timeout
        self.model = model
        self.keys = keys
        self.outcomes: list[Outcome] = []

    async def run(self, t0: float, until: float, phase_at: Callable[[float], str]) -> None:
        """Send from `t0` (time.monotonic) for `until` seconds; `phase_at(s)` names the
        phase a request due `s` seconds after `t0` belongs to. Waits for the last."""
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=32)
        clients = {
            name: httpx.AsyncClient(
                base_url=self.url,
                headers={"Authorization": f"Bearer {key}"},
                limits=limits,
                # The whole request's deadline is _send's; this only backs it up.
                timeout=self.timeout * 2,
            )
            for name, key in self.keys.items()
        }
        names = list(clients)
        kinds = legit_kinds()
        tasks: list[asyncio.Task[None]] = []
        try:
            i = 0
            while (due := i / self.rate) < until:
                delay = t0 + due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                name = names[i % len(names)]
                out = Outcome(due, next(kinds), name, phase_at(due))
                self.outcomes.append(out)
                tasks.append(asyncio.create_task(self._send(clients[name], out, i, t0)))
                i += 1
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            for client in clients.values():
                await client.aclose()

    async def _send(self, client: httpx.AsyncClient, out: Outcome, index: int, t0: float) -> None:
        path, body = legit_body(out.kind, index, self.model)
        headers = {"Content-Type": "application/json"}
        try:
            async with asyncio.timeout(self.timeout):
                async with client.stream("POST", path, content=body, headers=headers) as resp:
                    out.status = resp.status_code
                    done = False
                    async for line in resp.aiter_lines():
                        done = done or line.strip() == "data: [DONE]"
                    if out.kind == "stream" and resp.status_code == 200 and not done:
                        out.error = "stream cut"
            out.latency = time.monotonic() - t0 - out.due
        except (TimeoutError, httpx.TimeoutException):
            out.error = "timeout"
        except httpx.HTTPError:
            out.error = "connection"
