"""What a client key may learn about the engine: `/version` (the engine's vLLM version)
and `/tokenizer_info` (its model's path on disk and its chat template) need the `admin`
scope, like the gateway's own version; a default key is refused before the engine.
Through the gateway under uvicorn in front of a simulated engine that records what it
receives."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from bench.harness.metrics import HTTP
from tests.procs import Proc, auth, error_code, gateway_proc, running, sim_proc, wait_for

CLIENT = "key-client-0123456789abcdef"  # no scopes: every forwarded group
ADMIN = "key-admin-0123456789abcdef"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("engine-info")
    sim = sim_proc(tmp, "--record-requests", "50", "--latency", "zero")
    with running(sim):
        keys = [CLIENT, {"key": ADMIN, "scopes": ["admin", "info", "tokenize"]}]
        env = {"GATEWAY_ENGINES": json.dumps([sim.url]), "GATEWAY_API_KEYS": json.dumps(keys)}
        gateway = gateway_proc(tmp, env)
        with running(gateway, ready_path="/healthz"):
            assert wait_for(lambda: HTTP.get(gateway.url + "/readyz").status_code == 200)
            yield sim, gateway


def engine_saw(sim: Proc, path: str) -> int:
    return sum(1 for r in HTTP.get(sim.url + "/sim/requests").json() if r["path"] == path)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/version", "/tokenizer_info"])
def test_a_client_key_cannot_read_what_the_engine_runs(stack: tuple[Proc, Proc], path: str) -> None:
    sim, gateway = stack
    r = HTTP.get(gateway.url + path, headers=auth(CLIENT), timeout=10)
    assert (r.status_code, error_code(r)) == (403, "scope_not_allowed")
    assert engine_saw(sim, path) == 0


@pytest.mark.slow
def test_an_admin_key_reads_the_engines_version(stack: tuple[Proc, Proc]) -> None:
    sim, gateway = stack
    r = HTTP.get(gateway.url + "/version", headers=auth(ADMIN), timeout=10)
    assert r.status_code == 200 and "version" in r.json()
    assert engine_saw(sim, "/version") == 1
