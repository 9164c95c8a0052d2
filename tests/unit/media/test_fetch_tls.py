"""The media fetcher over real TLS on loopback, at the transport level with an injected
resolver: the handshake names the URL's host (SNI) and the certificate is checked
against that name, while the socket goes to the address that was checked.
Through the gateway under uvicorn: tests/e2e/test_media_tls.py."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import pytest

from gateway.errors import MediaFetchFailed
from gateway.media.fetch import MediaFetcher, default_inner_transport
from gateway.media.settings import MediaSettings
from gateway.media.urls import RemoteUrl, UrlPolicy
from tests.e2e.test_media_tls import PNG, TLS, Origin
from tests.unit.media.test_fetch import StaticResolver


@pytest.fixture
def signed() -> Iterator[Origin]:
    origin = Origin("media")
    with origin.server:
        yield origin


@pytest.fixture
def self_signed() -> Iterator[Origin]:
    origin = Origin("selfsigned")
    with origin.server:
        yield origin


def _settings(port: int) -> MediaSettings:
    return MediaSettings.model_validate(
        {
            "allowed_domains": [f"media.test:{port}", f"other.test:{port}"],
            "allowed_schemes": ["https"],
            "allowed_networks": ["127.0.0.0/8"],
            "fetch_timeout": 2.0,
        }
    )


async def _fetch(port: int, host: str) -> bytes:
    settings = _settings(port)
    ref = UrlPolicy(settings).check(f"https://{host}:{port}/img.png")
    assert isinstance(ref, RemoteUrl)
    trust = ssl.create_default_context(cafile=TLS / "ca.pem")
    fetcher = MediaFetcher(
        settings,
        transport=default_inner_transport(verify=trust),
        resolver=StaticResolver(["127.0.0.1"]),
    )
    try:
        return (await fetcher.fetch(ref)).data
    finally:
        await fetcher.aclose()


async def test_handshake_names_the_host_and_the_socket_goes_to_the_checked_address(
    signed: Origin,
) -> None:
    assert await _fetch(signed.server.port, "media.test") == PNG
    # SNI carried the URL's name, not the IP the socket was opened to.
    assert signed.sni == ["media.test"]
    (hit,) = signed.server.hits
    assert {k.lower(): v for k, v in hit.headers.items()}["host"] == (
        f"media.test:{signed.server.port}"
    )


async def test_a_certificate_for_another_name_is_refused(signed: Origin) -> None:
    """other.test resolves to the same address, but the certificate there is for
    media.test: the handshake fails and no request is sent."""
    with pytest.raises(MediaFetchFailed, match=r"reason: connection\)") as info:
        await _fetch(signed.server.port, "other.test")
    assert info.value.status == 422 and info.value.code == "media_fetch_failed"
    # No library text reaches the client: not ssl's, not httpx's.
    assert "CERTIFICATE" not in str(info.value) and "ssl" not in str(info.value).lower()
    assert signed.sni == ["other.test"]
    assert signed.server.hits == []


async def test_a_certificate_from_an_untrusted_issuer_is_refused(self_signed: Origin) -> None:
    with pytest.raises(MediaFetchFailed, match=r"reason: connection\)") as info:
        await _fetch(self_signed.server.port, "media.test")
    assert info.value.code == "media_fetch_failed"
    assert self_signed.sni == ["media.test"]
    assert self_signed.server.hits == []
