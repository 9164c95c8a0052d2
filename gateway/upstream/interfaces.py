"""The seam between the gateway and its engine client: what the proxy and the pool send
requests with (`UpstreamClient`) and read answers from (`Response`). The real ones are
`Upstream` (client.py) and `UpstreamResponse` (connection.py); tests hand in a fake engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from gateway.upstream.origin import Origin

# Final statuses whose answer ends with its head, whatever its fields say (RFC 9112 6.3;
# httptools reads them so): no body is read for them, and none is relayed (proxy/relay.py).
NO_CONTENT: Final = frozenset({204, 304})


class Response(Protocol):
    """An engine's answer as the relay reads it (`UpstreamResponse`, or a test's fake)."""

    status: int
    # Names lower-cased, values as sent.
    raw_headers: list[tuple[bytes, bytes]]
    content_length: int | None
    content_type: str

    async def read(self, limit: float) -> bytes:
        """The whole body within `limit` seconds; raises ReadTimeout or ConnectionBroken."""
        ...

    async def readany(self) -> bytes:
        """The next bytes of the body, b"" at its end; raises ConnectionBroken."""
        ...

    async def readsome(self, limit: float) -> bytes:
        """`readany`, waiting at most `limit` seconds for the next bytes; raises
        ReadTimeout or ConnectionBroken."""
        ...

    def close(self) -> None:
        """Release the answer: its connection is reused only if it was read to the end."""
        ...


class UpstreamClient(Protocol):
    """What the proxy sends requests with (`Upstream`, or a test's fake engine)."""

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> Response:
        """Send one request and return once the response headers arrived. Raises
        ConnectFailed when nothing reached the engine, ReconnectFailed,
        FirstByteTimeout, or ConnectionBroken."""
        ...

    async def aclose(self) -> None: ...
