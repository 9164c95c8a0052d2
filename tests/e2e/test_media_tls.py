"""The media fetcher over real TLS on loopback: the handshake names the URL's host (SNI)
and the certificate is checked against that name, while the socket goes to the address
that was checked (SafeTransport pins the IP).

Certificates in tests/data/tls (test only, valid to 2126): `ca.pem` (its key was
discarded), `media.pem` for `media.test` and `loopback.pem` for the address 127.0.0.1,
both signed by it, and `selfsigned.pem` for `media.test`, signed by nobody trusted.

The name checks run at the transport level with an injected resolver in
tests/unit/media/test_fetch_tls.py (the gateway process resolves with the system).
Here, through the gateway under uvicorn, the origin is named by its address, with
and without `media.ca_file`.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.harness.samples import png
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
