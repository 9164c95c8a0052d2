"""Fake engines behind the `UpstreamClient` seam for in-process tests: a subclass of
`FakeEngine` says how it answers each request the gateway sends; `FakeResponse` is an
engine's answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.upstream.origin import Origin


class FakeResponse:
    """An engine's answer (the `Response` protocol), its body in the pieces given."""

    def __init__(self, status: int, body: Sequence[bytes], content_type: str) -> None:
        self.status = status
        self.content_type = content_type
        self.content_length: int | None = sum(map(len, body))
        self.raw_headers = [
            (b"content-type", content_type.encode()),
            (b"content-length", str(self.content_length).encode()),
        ]
        self._pieces = list(body)
        self.closed = False

    async def read(self, limit: float) -> bytes:
        body, self._pieces = b"".join(self._pieces), []
        return body

    async def readany(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""

    async def readsome(self, limit: float) -> bytes:
        return await self.readany()

    def close(self) -> None:
        self.closed = True


@dataclass
class Sent:
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: bytes | None


class FakeEngine:
    """The `UpstreamClient` seam: every request is handed to `answer`."""

    closed = False

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> FakeResponse:
        return await self.answer(Sent(method, target, list(headers), body))

    async def answer(self, sent: Sent) -> FakeResponse:
        raise NotImplementedError

    async def aclose(self) -> None:
        self.closed = True
