"""The media fetcher over real TLS on loopback: the handshake names the URL's host (SNI)
and the certificate is checked against that name, while the socket goes to the address
that was checked (SafeTransport pins the IP).

Certificates in tests/data/tls (test only, valid to 2126): `ca.pem` (its key was
discarded), `media.pem` for `media.test` and `loopback.pem` for the address 127.0.0.1,
both signed by it, and `selfsigned.pem` for `media.test`, signed by nobody trusted.

The name checks run at the transport level with an injected resolver (the gateway
process resolves with the system). Through the gateway under uvicorn the origin is
named by its address, with and without `media.ca_file`.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.samples import png
from gateway.errors import MediaFetchFailed
from gateway.media.fetch import MediaFetcher, default_inner_transport
from gateway.media.settings import MediaSettings
from gateway.media.urls import RemoteUrl, UrlPolicy
from tests.gateway.media.test_media_fetch import StaticResolver
from tests.procs import (
    ROOT,
    Proc,
    RecordingServer,
    Route,
    ask_about_image,
    gateway_proc,
    media_gateway_env,
    running,
    sim_proc,
    sim_received,
)

TLS = ROOT / "tests" / "data" / "tls"
PNG = png(16, 16)


class Origin:
    """An HTTPS media origin on 127.0.0.1 with the given certificate; records the SNI
    name of every handshake."""

    def __init__(self, cert: str) -> None:
        self.sni: list[str | None] = []
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(TLS / f"{cert}.pem", TLS / f"{cert}.key")
        context.sni_callback = lambda _sock, name, _ctx: self.sni.append(name)
        routes = {"/img.png": Route(body=PNG, headers={"Content-Type": "image/png"})}
        self.server = RecordingServer(routes, tls=context)


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


# --- through the gateway ----------------------------------------------------------------

KEY = "sk-media-tls-0123456789abcdef"


@dataclass
class Stack:
    origin: Origin
    sim: Proc
    trusting: Proc  # media.ca_file: the test CA
    default: Proc  # the default trust store


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("tls")
    origin = Origin("loopback")
    sim = sim_proc(tmp, "--latency", "zero")
    env = media_gateway_env(sim.url, KEY, f"127.0.0.1:{origin.server.port}", "https")
    trusting = gateway_proc(tmp, {**env, "GATEWAY_MEDIA__CA_FILE": str(TLS / "ca.pem")})
    default = gateway_proc(tmp, env)
    with origin.server, running(sim), running(trusting, default, ready_path="/readyz"):
        yield Stack(origin, sim, trusting, default)


def _ask(gateway: Proc, port: int) -> httpx.Response:
    return ask_about_image(gateway.url, KEY, f"https://127.0.0.1:{port}/img.png")


@pytest.mark.slow
def test_gateway_fetches_over_tls_from_an_origin_its_ca_file_trusts(stack: Stack) -> None:
    before, hits = sim_received(stack.sim.url), len(stack.origin.server.hits)
    resp = _ask(stack.trusting, stack.origin.server.port)
    assert resp.status_code == 200, resp.text
    assert len(stack.origin.server.hits) == hits + 1
    assert sim_received(stack.sim.url) == before + 1


@pytest.mark.slow
def test_gateway_refuses_an_origin_outside_its_trust_store(stack: Stack) -> None:
    before, hits = sim_received(stack.sim.url), len(stack.origin.server.hits)
    resp = _ask(stack.default, stack.origin.server.port)
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert error["code"] == "media_fetch_failed" and "reason: connection" in error["message"]
    assert "CERTIFICATE" not in resp.text and "ssl" not in resp.text.lower()
    # The handshake failed: no request reached the origin, nothing reached the engine.
    assert len(stack.origin.server.hits) == hits
    assert sim_received(stack.sim.url) == before
