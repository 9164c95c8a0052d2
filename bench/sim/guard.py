"""The simulator's own safety catch: media fetches connect to loopback addresses only.

The simulator fetches media like a default vLLM (any host, redirects followed), so that
the gateway's tests see the hole the gateway closes. A hole in a test or a gateway check
must not turn into traffic off this machine, so every connection the media client opens
is checked here, at connect time, against the address it actually connects to: a
redirect, a DNS name or an IPv4-mapped form cannot get around it. Only
`--allow-remote-media` lifts it, and no test or benchmark passes that flag.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class LoopbackOnly(httpcore.AsyncNetworkBackend):
    """A network backend that resolves the host itself and connects only when every
    address it resolves to is a loopback address."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}") from exc
        addresses = [str(info[4][0]) for info in infos]
        if not addresses or not all(is_loopback(a) for a in addresses):
            raise httpcore.ConnectError(
                f"refused: {host} is not a loopback address (the simulator fetches media "
                "from loopback only unless started with --allow-remote-media)"
            )
        # Connect to the address just checked, not to a second resolution of the name.
        return await self.inner.connect_tcp(
            addresses[0], port, timeout, local_address, socket_options
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("refused: unix sockets are not media origins")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def media_client(allow_remote: bool) -> httpx.AsyncClient:
    """The media client: like vLLM's MediaConnector (redirects followed, no proxy from the
    environment), confined to loopback unless `allow_remote`."""
    transport = httpx.AsyncHTTPTransport()
    if not allow_remote:
        # httpx takes no network backend of its own; its pool is the one place to put it.
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(), network_backend=LoopbackOnly()
        )
    return httpx.AsyncClient(follow_redirects=True, trust_env=False, transport=transport)
