"""DNS rebinding against the media fetcher, where the second lookup is the system's own.

tests/unit/media/test_fetch.py::test_dns_rebinding_cannot_move_the_connection
proves that the fetcher connects to the address its injected resolver returned, but its host name
(`rebind.test`) resolves nowhere else, so a fetcher that connected by name would fail
rather than land somewhere dangerous. The attack is different: the name is checked
once, and the library that connects resolves it again and gets a private address. Here
the name is `localhost`: the injected resolver (the check) answers 127.0.0.2, where the
real origin listens, while the system resolver (what a connect-by-name would use)
answers 127.0.0.1, where a private canary listens on the same port. The gateway
process cannot take an injected resolver, so this runs at the transport level.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator, Sequence

import httpx
import pytest

from gateway.media.addresses import Address
from gateway.media.fetch import MediaFetcher
from gateway.media.settings import MediaSettings
from gateway.media.urls import RemoteUrl, UrlPolicy
from tests.procs import RecordingServer, Route, SocketCanary
from tests.unit.media.test_samples import png

PNG = png(16, 16)


def _system_answers(port: int) -> set[str]:
    infos = socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


@pytest.fixture
def origin_and_canaries() -> Iterator[tuple[RecordingServer, list[SocketCanary]]]:
    """The origin on 127.0.0.2:P, canaries on every address the system gives for
    localhost, on the same port P."""
    routes = {"/img.png": Route(body=PNG, headers={"Content-Type": "image/png"})}
    for _ in range(20):
        origin = RecordingServer(routes, host="127.0.0.2")
        canaries: list[SocketCanary] = []
        try:
            for answer in sorted(_system_answers(origin.port)):
                family = socket.AF_INET6 if ":" in answer else socket.AF_INET
                canaries.append(SocketCanary(answer, origin.port, family))
        except OSError:
            for c in canaries:
                c.close()
            origin._server.server_close()
            continue
        with origin:
            try:
                yield origin, canaries
            finally:
                for c in canaries:
                    c.close()
        return
    raise RuntimeError("no port free on both 127.0.0.2 and the localhost addresses")


class Resolver:
    """The check's resolver: answers in turn, the last one repeated; counts calls."""

    def __init__(self, *answers: Sequence[str]) -> None:
        self.answers = [[ipaddress.ip_address(a) for a in group] for group in answers]
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[Address]:
        self.calls += 1
        return list(self.answers[min(self.calls, len(self.answers)) - 1])


async def test_the_connection_goes_to_the_checked_address_not_a_fresh_lookup(
    origin_and_canaries: tuple[RecordingServer, list[SocketCanary]],
) -> None:
    origin, canaries = origin_and_canaries
    port = origin.port
    assert "127.0.0.1" in _system_answers(port)

    # Control: a client that connects by name lands on the private canary.
    async with httpx.AsyncClient(trust_env=False) as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get(f"http://localhost:{port}/img.png", timeout=2)
    assert sum(c.accepted for c in canaries) == 1
    for c in canaries:
        c.accepted = 0

    settings = MediaSettings(
        allowed_domains=[f"localhost:{port}"],
        allowed_schemes=["http"],
        allowed_networks=["127.0.0.2/32"],
        fetch_timeout=2.0,
    )
    url = UrlPolicy(settings).check(f"http://localhost:{port}/img.png")
    assert isinstance(url, RemoteUrl)
    # The check's lookup answers the origin; any later lookup would answer the canary.
    resolver = Resolver(["127.0.0.2"], ["127.0.0.1"])
    fetcher = MediaFetcher(settings, resolver=resolver)
    try:
        fetched = await fetcher.fetch(url)
    finally:
        await fetcher.aclose()
    assert fetched.data == PNG
    assert resolver.calls == 1
    assert sum(c.accepted for c in canaries) == 0
    (hit,) = origin.hits
    assert {k.lower(): v for k, v in hit.headers.items()}["host"] == f"localhost:{port}"
