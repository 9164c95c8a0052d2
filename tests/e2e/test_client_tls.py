"""The gateway serving its clients over TLS (`serve --ssl-certfile/--ssl-keyfile`), under
uvicorn with one and two workers, on a CA and certificate trustme makes per test: a
client trusting the CA reaches the engine, a plain-HTTP client and a client that does
not trust the CA get nothing, and the gateway's own limits still hold under TLS."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trustme

from bench.sim.config import DEFAULT_MODEL
from tests.procs import Proc, auth, error_code, gateway_proc, running, sim_received

KEY = "sk-client-tls-0123456789abcdef"
CHAT = {
    "model": DEFAULT_MODEL,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "Hello"}],
}


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    """A client context that trusts `ca` (and checks names, as every client does)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def tls_files(tmp: Path, ca: trustme.CA) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by `ca`, and its key, as PEM files."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = tmp / "gateway.pem", tmp / "gateway.key"
    cert.private_key_pem.write_to_path(str(keyfile))
    certfile.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return certfile, keyfile


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_clients_reach_the_engine_over_tls_and_only_over_tls(
    tmp_path: Path, start_sim: Callable[..., Proc], workers: str
) -> None:
    sim = start_sim("--latency", "zero")
    ca = trustme.CA()
    certfile, keyfile = tls_files(tmp_path, ca)
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_LIMITS__MAX_HEADER_BYTES": "4096",
    }
    opts = ("--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile), "--workers", workers)
    gateway = gateway_proc(tmp_path, env, *opts, tls=trusting(ca))
    assert gateway.url.startswith("https://")
    with running(gateway, ready_path="/readyz"):
        before = sim_received(sim.url)
        with httpx.Client(base_url=gateway.url, verify=trusting(ca), timeout=30) as client:
            r = client.post("/v1/chat/completions", headers=auth(KEY), json=CHAT)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            with client.stream(
                "POST", "/v1/chat/completions", headers=auth(KEY), json={**CHAT, "stream": True}
            ) as stream:
                assert stream.status_code == 200
                assert "data: [DONE]" in "".join(stream.iter_text())
            # The gateway's own head limit, not uvicorn's, under TLS too.
            big = client.get("/v1/models", headers={**auth(KEY), "x-pad": "a" * 8192})
            assert (big.status_code, error_code(big)) == (431, "headers_too_large")
        assert sim_received(sim.url) == before + 2
        # Plain HTTP to the TLS port: the handshake fails, nothing is answered.
        plain = gateway.url.replace("https://", "http://")
        with pytest.raises(httpx.TransportError):
            httpx.get(plain + "/v1/models", headers=auth(KEY), timeout=10)
        # A client that does not trust the CA refuses the certificate.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(gateway.url + "/v1/models", headers=auth(KEY), timeout=10)
        # ... and one trusting another CA alike.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(gateway.url + "/healthz", verify=trusting(trustme.CA()), timeout=10)
        assert sim_received(sim.url) == before + 2
    serving = [json.loads(x) for x in gateway.log().splitlines() if '"gateway_serving"' in x]
    assert serving and serving[0]["listen"] == [gateway.url]
    assert KEY not in gateway.log()
