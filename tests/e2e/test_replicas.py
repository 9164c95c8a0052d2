"""One gateway as several processes: the identities it makes hold across replicas that
share `payload.namespace_secret`, and a gateway that has to generate its own says so.

Two gateway processes (replicas A and B) with the same secret, and a third (C) with
another, in front of ONE simulated engine with vLLM's response store on: a stored
response made through A is read and continued through B; C does not know its id and
answers 404 `response_not_found` without asking the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    error_code,
    every_worker_lists,
    gateway_proc,
    metric,
    run_cli,
    running,
    sim_proc,
    wait_for,
)

KEY = "sk-replicas-0123456789abcdef"
OTHER_KEY = "sk-replicas-other-0123456789abcdef"
NAMESPACE_SECRET = "replicas-namespace-0123456789abcdef"
ANOTHER_SECRET = "replicas-another-0123456789abcdef"
WARNING = "namespace_secret_generated"
# The simulated engine's route labels (sim:received_requests_total).
CREATE = "/v1/responses"
RETRIEVE = "/v1/responses/{response_id}"
CANCEL = "/v1/responses/{response_id}/cancel"


@dataclass
class Replicas:
    sim: Proc
    a: Proc
    b: Proc
    c: Proc  # another secret

    def create(self, gateway: Proc, key: str = KEY, **fields: Any) -> httpx.Response:
        body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 8, **fields}
        return HTTP.post(gateway.url + "/v1/responses", json=body, headers=auth(key), timeout=30)

    def read(self, gateway: Proc, response_id: str, key: str = KEY) -> httpx.Response:
        return HTTP.get(f"{gateway.url}/v1/responses/{response_id}", headers=auth(key), timeout=30)

    def engine_got(self) -> dict[str, float]:
        return {
            label: metric(self.sim.url, "sim:received_requests_total", path=label)
            for label in (CREATE, RETRIEVE, CANCEL)
        }


def _env(engine: str, secret: str) -> dict[str, str]:
    return {
        "GATEWAY_ENGINES": json.dumps([engine]),
        "GATEWAY_API_KEYS": json.dumps([KEY, OTHER_KEY]),
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": secret,
    }


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("replicas")
    sim = sim_proc(tmp, "--latency", "zero", "--enable-responses-api-store")
    with running(sim):
        a, b = (gateway_proc(tmp, _env(sim.url, NAMESPACE_SECRET)) for _ in range(2))
        c = gateway_proc(tmp, _env(sim.url, ANOTHER_SECRET))
        with running(a, b, c, ready_path="/readyz"):
            yield Replicas(sim, a, b, c)


def test_a_response_made_through_one_replica_is_read_through_another(
    replicas: Replicas,
) -> None:
    made = replicas.create(replicas.a)
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    # The id the gateway gave the engine (`gw-` + digits + their tag), not vLLM's resp_.
    assert response_id.startswith("gw-") and len(response_id) == 67
    read = replicas.read(replicas.b, response_id)
    assert read.status_code == 200, read.text
    assert read.json() == made.json()
    # Continued through B, and the continuation read back through A.
    more = replicas.create(replicas.b, previous_response_id=response_id, input="And again.")
    assert more.status_code == 200, more.text
    assert more.json()["previous_response_id"] == response_id
    assert replicas.read(replicas.a, more.json()["id"]).status_code == 200
    # The id is still bound to its key on every replica.
    other = replicas.read(replicas.b, response_id, key=OTHER_KEY)
    assert (other.status_code, error_code(other)) == (404, "response_not_found")
    # Configured secrets: none of the replicas generated one.
    for gateway in (replicas.a, replicas.b, replicas.c):
        assert WARNING not in gateway.log()


def test_a_replica_with_another_secret_does_not_know_the_id(replicas: Replicas) -> None:
    made = replicas.create(replicas.a)
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    before = replicas.engine_got()
    read = replicas.read(replicas.c, response_id)
    assert (read.status_code, error_code(read)) == (404, "response_not_found")
    cancel = HTTP.post(
        f"{replicas.c.url}/v1/responses/{response_id}/cancel", headers=auth(KEY), timeout=30
    )
    assert (cancel.status_code, error_code(cancel)) == (404, "response_not_found")
    more = replicas.create(replicas.c, previous_response_id=response_id)
    assert (more.status_code, error_code(more)) == (404, "response_not_found")
    assert replicas.engine_got() == before, "a refused request reached the engine"
    # The engine does have it: B, with A's secret, reads it.
    assert replicas.read(replicas.b, response_id).status_code == 200


def _warnings(text: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("event") == WARNING]


@pytest.mark.slow
def test_workers_without_a_secret_warn_once(tmp_path: Path) -> None:
    """`serve --workers 2` without a secret generates one in the parent and hands it to
    both workers: the warning comes once, from the parent, and says what breaks."""
    sim = sim_proc(tmp_path, "--latency", "zero")
    env = {"GATEWAY_ENGINES": json.dumps([sim.url]), "GATEWAY_API_KEYS": json.dumps([KEY])}
    gateway = gateway_proc(tmp_path, env, "--workers", "2")
    with running(sim), running(gateway, ready_path="/healthz"):
        headers = {**auth(KEY), "Connection": "close"}
        assert wait_for(lambda: every_worker_lists(gateway, 2, MODEL, headers), timeout=60)
        log = gateway.log()
    (warning,) = _warnings(log)
    assert warning["level"] == "warning"
    assert "other replicas" in warning["breaks"] and "restart" in warning["breaks"]
    assert "payload.namespace_secret" in warning["fix"]


def test_a_single_process_without_a_secret_warns_once(tmp_path: Path) -> None:
    """`check-config` builds the gateway as a one-worker `serve` does; its log goes to
    stderr, in the console format. With a secret configured there is no warning."""
    # An engine is configured (a configuration without one is refused); check-config
    # does not contact it.
    engines = json.dumps(["http://127.0.0.1:9"])
    env = {"GATEWAY_API_KEYS": json.dumps([KEY]), "GATEWAY_ENGINES": engines}
    result = run_cli("check-config", env=env)
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if WARNING in x]
    assert "[warning" in line and "other replicas" in line
    configured = run_cli(
        "check-config", env={**env, "GATEWAY_PAYLOAD__NAMESPACE_SECRET": NAMESPACE_SECRET}
    )
    assert configured.returncode == 0, configured.stderr
    assert WARNING not in configured.stderr
    assert NAMESPACE_SECRET not in configured.stderr + configured.stdout
