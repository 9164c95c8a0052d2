"""Engines over TLS, named by DNS: `dns+https://localhost:PORT` through the real gateway.

The entry resolves to 127.0.0.1 (and on most hosts ::1, where nothing listens): the
gateway connects to the address, while the TLS server name (SNI), the certificate check
and the Host header use the name. The CA that signs the engine's certificate is
`engine_ca_file`; the same client and TLS configuration serve health checks, model
lists and forwarded requests, so an engine is ready only if its certificate passes.

The engine is a recording HTTPS server on 127.0.0.1 (tests/data/tls: `localhost.pem`
and `engine-test.pem`, both signed by `engine-ca.pem`). A failed handshake sends no
request: `hits` stays empty, while `sni` shows the gateway did try.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import ROOT, Proc, RecordingServer, Route, gateway_proc, wait_for

TLS = ROOT / "tests" / "data" / "tls"
KEY = "sk-engine-tls-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = {"Content-Type": "application/json"}
ROUTES = {
    "/health": Route(200),
    "/v1/models": Route(200, json.dumps({"data": [{"id": MODEL}]}).encode(), JSON),
    "/v1/chat/completions": Route(200, b'{"id":"c","object":"chat.completion"}', JSON),
}


class TlsEngine:
    """An HTTPS engine on 127.0.0.1 with the given certificate; records every SNI name."""

    def __init__(self, cert: str) -> None:
        self.sni: list[str | None] = []
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(TLS / f"{cert}.pem", TLS / f"{cert}.key")
        context.sni_callback = lambda _sock, name, _ctx: self.sni.append(name)
        self.server = RecordingServer(ROUTES, tls=context)

    @property
    def entry(self) -> str:
        return f"dns+https://localhost:{self.server.port}"


@contextmanager
def gateway(tmp: Path, engine: TlsEngine, ca_file: str | None) -> Iterator[Proc]:
    env = {
        "GATEWAY_ENGINES": json.dumps([engine.entry]),
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_PUBLIC_METRICS": "true",
    }
    if ca_file is not None:
        env["GATEWAY_ENGINE_CA_FILE"] = str(TLS / ca_file)
    proc = gateway_proc(tmp, env)
    with engine.server:
        proc.start("/healthz")
        try:
            yield proc
        finally:
            proc.stop()


@pytest.mark.slow
def test_an_engine_named_by_dns_is_reached_over_tls_under_its_name(tmp_path: Path) -> None:
    engine = TlsEngine("localhost")
    with gateway(tmp_path, engine, "engine-ca.pem") as gw:
        # Ready: the health check and the model list passed the certificate check.
        ready = lambda: HTTP.get(gw.url + "/readyz").status_code == 200  # noqa: E731
        assert wait_for(ready, timeout=10), gw.log()
        r = HTTP.post(gw.url + "/v1/chat/completions", headers=HEADERS, json=CHAT, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "chat.completion"
        samples = HTTP.get(gw.url + "/metrics").text
    paths = [h.path for h in engine.server.hits]
    assert {"/health", "/v1/models", "/v1/chat/completions"} <= set(paths)
    # Every handshake named the engine, not the address the socket went to.
    assert engine.sni and set(engine.sni) == {"localhost"}
    hosts = {h.headers.get("Host") for h in engine.server.hits}
    assert hosts == {f"localhost:{engine.server.port}"}
    # The engine is listed by its address (one per resolved address).
    assert f'engine="https://127.0.0.1:{engine.server.port}"' in samples


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cert", "ca_file"),
    [
        ("engine-test", "engine-ca.pem"),  # a trusted certificate for engine.test
        ("localhost", None),  # the right name, an issuer the system does not trust
    ],
)
def test_an_engine_whose_certificate_fails_is_never_used(
    tmp_path: Path, cert: str, ca_file: str | None
) -> None:
    engine = TlsEngine(cert)
    with gateway(tmp_path, engine, ca_file) as gw:
        # Health checks keep trying (every 0.25 s while nothing is ready) and failing.
        assert wait_for(lambda: len(engine.sni) >= 3, timeout=10), gw.log()
        time.sleep(0.3)
        r = HTTP.get(gw.url + "/readyz")
        assert (r.status_code, r.json()["healthy_engines"]) == (503, 0)
        assert r.json()["engine_states"] == [{"index": 0, "healthy": False, "reason": "tls_failed"}]
        r = HTTP.post(gw.url + "/v1/chat/completions", headers=HEADERS, json=CHAT, timeout=10)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "no_engine_available")
        assert "certificate" not in r.text.lower()
    # No handshake completed: no request of any kind reached the engine.
    assert engine.server.hits == []
    assert set(engine.sni) == {"localhost"}
