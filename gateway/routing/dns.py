"""Engine entries given as DNS names (`dns+http://name:port`), resolved to every address.

A Kubernetes headless service names one A/AAAA record per ready pod: resolving it to all
of its addresses, again every `routing.dns_interval` seconds, lets engines join and leave
the pool as pods come and go. Each address becomes one engine URL (`http://10.0.0.7:8000`,
`http://[fd00::7]:8000`), so rendezvous hashing sees the same URLs on every replica that
resolves the same records. The engine keeps the entry's name (`DnsEntry.host`) for its
Host header and, with `dns+https://`, for TLS: the certificate names the service, not a
pod's address (engine.Engine, gateway/upstream/origin.py's Origin).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

# A name that does not exist, or has no address of the asked family: the service has no
# ready pods, so the entry has no engines. Any other failure (a resolver timeout,
# EAI_AGAIN) keeps the last good answer: a resolver hiccup must not empty the pool.
_NO_ADDRESSES = frozenset(
    code for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None))
    if code is not None
)  # fmt: skip

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class NameNotFound(Exception):
    """The name has no addresses (as opposed to a lookup that failed)."""


class DnsEntry:
    """One `dns+http://name:port[/path]` (or `dns+https://`) entry of `GATEWAY_ENGINES`."""

    __slots__ = ("base_path", "host", "port", "scheme", "spec")

    def __init__(self, spec: str) -> None:
        parts = urlsplit(spec)
        scheme = parts.scheme.removeprefix("dns+")
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine entry {spec!r}: expected dns+http://name:port")
        if parts.username is not None or parts.query or parts.fragment:
            raise ValueError(f"engine entry {spec!r}: no credentials, query or fragment")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"engine entry {spec!r}: invalid port") from None
        self.spec = spec
        self.scheme = scheme
        self.host = parts.hostname
        self.port = port or (443 if scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/")

    def url(self, address: str) -> str:
        """The engine URL for one resolved address."""
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return f"{self.scheme}://{host}:{self.port}{self.base_path}"


def is_dns_entry(spec: str) -> bool:
    # Any `dns+` prefix is a DNS entry, so `dns+ftp://` is refused, not taken for a URL.
    return spec.lower().startswith("dns+")


async def resolve(host: str, port: int) -> list[str]:
    """Every A and AAAA address of `host`, sorted. Raises NameNotFound when there are
    none, OSError when the lookup itself failed."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESSES:
            raise NameNotFound(host) from None
        raise
    addresses = {
        str(info[4][0])
        for info in infos
        # Scoped (link-local) IPv6 addresses are left out: an engine URL cannot carry
        # the zone, and engines are not reached over link-local addresses.
        if info[0] in (socket.AF_INET, socket.AF_INET6) and "%" not in str(info[4][0])
    }
    if not addresses:
        raise NameNotFound(host)
    return sorted(addresses)
