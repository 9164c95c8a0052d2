"""Fetching media without letting a client steer the connection.

`SafeTransport` wraps an httpx transport: it resolves the host name once, refuses the
request unless every answer is an allowed address, and connects to the address it
checked, keeping the host name for `Host`, SNI and certificate checks. So a DNS answer
that changes between check and connect (rebinding) cannot move the connection.

`MediaFetcher` owns the `httpx.AsyncClient`: no redirects (vLLM follows them unchecked,
docs/vllm.md), no proxy environment variables, identity encoding only, a byte cap
enforced while streaming, a total time cap and a cap on concurrent fetches, its slots
shared fairly between keys (slots.py). Every
failure is a `MediaFetchFailed` naming its reason; library text never reaches a client.
The caller must `await fetcher.aclose()`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx

from gateway.config.tls import client_context
from gateway.errors import MediaFetchFailed, MediaTooLarge
from gateway.media.addresses import Address, AddressPolicy
from gateway.media.settings import MediaSettings
from gateway.media.slots import FairSlots
from gateway.media.urls import RemoteUrl

# Resolves (host, port) to addresses. Injectable so tests can simulate DNS rebinding.
Resolver = Callable[[str, int], Awaitable[Sequence[Address]]]


async def system_resolver(host: str, port: int) -> list[Address]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[Address] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0])
        if address not in out:
            out.append(address)
    return out


class FetchAllowance:
    """The bytes one request's media URLs may still bring in (`max_request_fetch_bytes`),
    charged as they stream in; MediaTooLarge once they are spent."""

    __slots__ = ("remaining",)

    def __init__(self, limit: int) -> None:
        self.remaining = limit

    def take(self, amount: int) -> None:
        self.remaining -= amount
        if self.remaining < 0:
            raise MediaTooLarge("The request's media are larger than this gateway accepts.")


def _failed(reason: str) -> MediaFetchFailed:
    return MediaFetchFailed(f"The media URL could not be fetched (reason: {reason}).")


class SafeTransport(httpx.AsyncBaseTransport):
    """Resolve once, check every answer, connect to the checked address."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        addresses: AddressPolicy,
        resolver: Resolver,
    ) -> None:
        self._inner = inner
        self._addresses = addresses
        self._resolver = resolver

    async def _resolve(self, host: str, port: int) -> Sequence[Address]:
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            pass
        try:
            answers = await self._resolver(host, port)
        except (OSError, UnicodeError):
            raise _failed("dns") from None
        if not answers:
            raise _failed("dns")
        return answers

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        host = url.host
        port = url.port or (443 if url.scheme == "https" else 80)
        answers = await self._resolve(host, port)
        # Every answer must pass: a resolver may hand a client's name both a public and
        # a private address, and the OS would be free to pick either.
        if not all(self._addresses.allows(a) for a in answers):
            # Names the setting an operator changes to allow the address, never the
            # address or the networks allowed.
            raise _failed(
                "address refused: the host resolves to an address that is not public "
                "and not in the gateway's media.allowed_networks"
            )
        extensions = dict(request.extensions)
        if url.scheme == "https":
            # Certificate and SNI checks run against the name, the socket to the IP.
            extensions["sni_hostname"] = host
        pinned = httpx.Request(
            request.method,
            url.copy_with(host=str(answers[0])),
            headers=request.headers,  # carries Host: <name>, set from the original URL
            stream=request.stream,
            extensions=extensions,
        )
        return await self._inner.handle_async_request(pinned)

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass(frozen=True)
class Fetched:
    data: bytes
    content_type: str | None


def default_inner_transport(verify: ssl.SSLContext | bool) -> httpx.AsyncHTTPTransport:
    """`verify`: the certificate check (httpx's default trust store; a context trusting
    another CA in tests). No keep-alive: the pool is keyed by IP, and a TLS connection
    verified for one host name must not be reused for another name that resolves to
    the same address."""
    return httpx.AsyncHTTPTransport(
        verify=verify,
        retries=0,
        trust_env=False,
        limits=httpx.Limits(max_keepalive_connections=0),
    )


class MediaFetcher:
    """GETs a canonical `RemoteUrl` under the settings' caps."""

    def __init__(
        self,
        settings: MediaSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self._max_bytes = settings.max_bytes
        self._timeout = settings.fetch_timeout
        self._slots = FairSlots(settings.max_concurrent_fetches)
        if transport is None:
            verify: ssl.SSLContext | bool = True
            if settings.ca_file is not None:
                verify = client_context(settings.ca_file)
            transport = default_inner_transport(verify)
        safe = SafeTransport(
            transport,
            AddressPolicy(settings.allowed_networks),
            resolver or system_resolver,
        )
        self._client = httpx.AsyncClient(
            transport=safe,
            trust_env=False,
            follow_redirects=False,
            timeout=httpx.Timeout(settings.fetch_timeout),
            headers={"Accept-Encoding": "identity", "User-Agent": "vllm-gateway"},
        )

    async def fetch(
        self, url: RemoteUrl, owner: str = "", allowance: FetchAllowance | None = None
    ) -> Fetched:
        """GET `url` in one of the fetch slots, shared fairly between owners (keys); its
        bytes are charged to `allowance` (the request's) as they arrive."""
        target = httpx.URL(
            scheme=url.scheme, host=url.host, port=url.port, raw_path=url.target.encode()
        )
        try:
            # The time cap covers the wait for a slot.
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire(owner)
                try:
                    return await self._get(target, allowance)
                finally:
                    self._slots.release(owner)
        except TimeoutError:
            raise _failed("timeout") from None
        except httpx.TimeoutException:
            raise _failed("timeout") from None
        except httpx.HTTPError:
            raise _failed("connection") from None

    async def _get(self, target: httpx.URL, allowance: FetchAllowance | None) -> Fetched:
        async with self._client.stream("GET", target) as response:
            if 300 <= response.status_code < 400:
                raise _failed("redirect")
            if response.status_code != 200:
                raise _failed(f"status {response.status_code}")
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding != "identity":
                raise _failed("content encoding")
            length = response.headers.get("content-length")
            if length is not None and "transfer-encoding" in response.headers:
                # Framed two ways (RFC 9112 6.3: a sign of smuggling); the client reads the
                # chunks whatever the length says.
                raise _failed("framing")
            if length is not None and (not length.isdigit() or int(length) > self._max_bytes):
                raise _failed("size")
            # An announced size is charged at once (a request over its allowance fails
            # before the bytes come), and any byte past it as it streams: the charge
            # follows the bytes read, not what the origin said it would send.
            charged = 0
            if allowance is not None and length is not None:
                charged = int(length)
                allowance.take(charged)
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if allowance is not None and len(body) > charged:
                    allowance.take(len(body) - charged)
                    charged = len(body)
                if len(body) > self._max_bytes:
                    raise _failed("size")
            return Fetched(bytes(body), response.headers.get("content-type"))

    async def aclose(self) -> None:
        await self._client.aclose()
