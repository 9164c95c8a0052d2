"""The control plane (gateway/control.py) through a running gateway in front of a
simulated engine: /gateway/status and its schema need the `admin` scope, say what the
pool, the keys and the key file are, and carry no key material; /healthz and /readyz
keep their bodies and need no key."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from gateway.access.endpoints import TABLE, Action
from tests.procs import (
    Proc,
    auth,
    error_code,
    gateway_proc,
    held_streams,
    sim_proc,
    sim_received,
    wait_for,
)

UPSTREAM = "upstream-control-0123456789"
ADMIN = "sk-control-admin-0123456789-SECRET"
PLAIN = "sk-control-plain-0123456789-SECRET"
METRICS = "sk-control-metrics-0123456789-SECRET"
EVERYTHING = "sk-control-everything-0123456789-SECRET"
FILE_KEY = "sk-control-file-0123456789-SECRET"
SECOND_FILE_KEY = "sk-control-file-two-0123456789-SECRET"
WRONG = "sk-control-not-configured-0123456789"
SECRETS = (ADMIN, PLAIN, METRICS, EVERYTHING, FILE_KEY, SECOND_FILE_KEY, UPSTREAM)
ALL_SCOPES = ["inference", "pooling", "tokenize", "audio", "models", "info", "metrics"]
CONTROL_PATHS = {"/healthz", "/readyz", "/metrics", "/gateway/status"}


@dataclass
class Stack:
    sim: Proc
    gateway: Proc
    key_file: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("control")
    key_file = tmp / "keys.yaml"
    key_file.write_text(f"- key: {FILE_KEY}\n  name: from-file\n")
    sim = sim_proc(tmp, "--api-key", UPSTREAM)
    keys = [
        {"key": ADMIN, "name": "ops", "scopes": ["admin"]},
        {"key": PLAIN, "name": "plain"},
        {"key": METRICS, "name": "scraper", "scopes": ["metrics"]},
        # Every scope but admin: admin is granted only by name.
        {"key": EVERYTHING, "name": "everything", "scopes": ALL_SCOPES},
    ]
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_API_KEYS_FILE": str(key_file),
        "GATEWAY_UPSTREAM_API_KEY": UPSTREAM,
        "GATEWAY_ROUTING__POLICY": "least_loaded",
    }
    gateway = gateway_proc(tmp, env)
    try:
        sim.start()
        gateway.start("/healthz")
        assert wait_for(lambda: HTTP.get(gateway.url + "/readyz").status_code == 200)
        yield Stack(sim, gateway, key_file)
    finally:
        gateway.stop()
        sim.stop()


def status(stack: Stack) -> dict[str, Any]:
    r = HTTP.get(stack.gateway.url + "/gateway/status", headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


REFUSALS = [
    (None, 401, "invalid_api_key"),
    ({"Authorization": f"Bearer {WRONG}"}, 401, "invalid_api_key"),
    ({"Authorization": ADMIN}, 401, "invalid_api_key"),
    (auth(PLAIN), 403, "scope_not_allowed"),
    (auth(METRICS), 403, "scope_not_allowed"),
    (auth(EVERYTHING), 403, "scope_not_allowed"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/gateway/status", "/gateway/openapi.json"])
@pytest.mark.parametrize(("headers", "code_status", "code"), REFUSALS)
def test_control_routes_need_the_admin_scope(
    stack: Stack, path: str, headers: dict[str, str] | None, code_status: int, code: str
) -> None:
    before = sim_received(stack.sim.url)
    r = HTTP.get(stack.gateway.url + path, headers=headers)
    assert (r.status_code, error_code(r)) == (code_status, code)
    assert "engines" not in r.text and "openapi" not in r.text
    assert sim_received(stack.sim.url) == before


@pytest.mark.slow
def test_status_refuses_other_methods_and_serves_no_docs_ui(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    r = HTTP.post(stack.gateway.url + "/gateway/status", headers=auth(ADMIN))
    assert (r.status_code, error_code(r)) == (405, "method_not_allowed")
    for path in ("/gateway/docs", "/gateway/redoc", "/gateway"):
        r = HTTP.get(stack.gateway.url + path, headers=auth(ADMIN))
        assert (r.status_code, error_code(r)) == (404, "unknown_endpoint"), path
    # The engine's own schema and docs stay blocked.
    r = HTTP.get(stack.gateway.url + "/openapi.json", headers=auth(ADMIN))
    assert (r.status_code, error_code(r)) == (403, "endpoint_blocked")
    assert sim_received(stack.sim.url) == before


@pytest.mark.slow
def test_status_describes_engines_policy_keys_and_version(stack: Stack) -> None:
    body = status(stack)
    assert body["version"] == "0.1.0"
    assert body["policy"] == "least_loaded"
    assert body["ready"] is True
    [engine] = body["engines"]
    assert engine["url"] == stack.sim.url
    assert engine["healthy"] is True
    assert MODEL in engine["models"]
    assert engine["in_flight"] == 0
    # The engine's own figures, scraped every routing.load_interval (1 s by default).
    assert engine["running"] == 0 and engine["waiting"] == 0
    assert engine["kv_cache_usage"] == 0.0
    # Its prefix cache's counters are read too (the tokens it recomputed lately).
    assert isinstance(engine["recomputed_tokens"], float) and engine["recomputed_tokens"] >= 0
    assert engine["ejections"] == 0
    assert engine["reason"] is None and engine["detail"] is None
    assert abs(time.time() - _epoch(engine["since"])) < 600
    assert body["dns_entries"] == []
    assert body["keys"]["in_force"] == 5
    key_file = body["keys"]["file"]
    assert key_file["path"] == str(stack.key_file)
    assert key_file["keys"] == 1
    assert key_file["refused_at"] is None
    loaded = key_file["loaded_at"]
    assert abs(time.time() - _epoch(loaded)) < 600


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.slow
def test_status_carries_no_key_material(stack: Stack) -> None:
    text = HTTP.get(stack.gateway.url + "/gateway/status", headers=auth(ADMIN)).text
    for secret in SECRETS:
        assert secret not in text
        assert hashlib.sha256(secret.encode()).hexdigest() not in text
    # Not even key names: the status counts keys.
    assert '"ops"' not in text and "from-file" not in text


@pytest.mark.slow
async def test_status_shows_the_requests_in_flight(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count slowly"}],
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    client = httpx.AsyncClient(base_url=stack.gateway.url, timeout=30)
    async with client, held_streams(client, 2, PLAIN, body):
        [engine] = status(stack)["engines"]
        assert engine["in_flight"] == 2
    assert wait_for(lambda: status(stack)["engines"][0]["in_flight"] == 0)


@pytest.mark.slow
def test_status_follows_the_key_file(stack: Stack) -> None:
    first = status(stack)["keys"]["file"]
    try:
        # An invalid file is refused: the keys in force stay, the status says when.
        stack.key_file.write_text("- key: short\n")
        assert wait_for(lambda: status(stack)["keys"]["file"]["refused_at"] is not None)
        refused = status(stack)["keys"]
        assert refused["in_force"] == 5
        assert refused["file"]["keys"] == 1 and refused["file"]["loaded_at"] == first["loaded_at"]
        assert HTTP.get(stack.gateway.url + "/v1/models", headers=auth(FILE_KEY)).status_code == 200
        # A good file is loaded: its count, a new time, the refusal is over.
        stack.key_file.write_text(
            f"- key: {FILE_KEY}\n  name: from-file\n- key: {SECOND_FILE_KEY}\n  name: second\n"
        )
        assert wait_for(lambda: status(stack)["keys"]["file"]["keys"] == 2)
        loaded = status(stack)["keys"]
        assert loaded["in_force"] == 6 and loaded["file"]["refused_at"] is None
        assert _epoch(loaded["file"]["loaded_at"]) > _epoch(first["loaded_at"])
        assert "second" not in json.dumps(loaded)
    finally:
        stack.key_file.write_text(f"- key: {FILE_KEY}\n  name: from-file\n")
        assert wait_for(lambda: status(stack)["keys"]["file"]["keys"] == 1)


@pytest.mark.slow
def test_openapi_schema_lists_only_the_control_routes(stack: Stack) -> None:
    r = HTTP.get(stack.gateway.url + "/gateway/openapi.json", headers=auth(ADMIN))
    assert r.status_code == 200
    schema = r.json()
    assert set(schema["paths"]) == CONTROL_PATHS
    forwarded = {route.path for route in TABLE.values() if route.action is Action.forward}
    assert not forwarded & set(schema["paths"])
    for path in forwarded:
        assert f'"{path}"' not in r.text, path
    assert schema["info"]["version"] == "0.1.0"
    # The answers are described by their models, and the keyed routes say so.
    status_op = schema["paths"]["/gateway/status"]["get"]
    ref = status_op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/GatewayStatus"
    assert {"401", "403"} <= set(status_op["responses"])
    assert status_op["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]
    engine = schema["components"]["schemas"]["EngineStatus"]["properties"]
    assert {"url", "healthy", "models", "in_flight", "waiting", "ejections"} <= set(engine)
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


@pytest.mark.slow
def test_probes_need_no_key_and_keep_their_bodies(stack: Stack) -> None:
    r = HTTP.get(stack.gateway.url + "/healthz")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert r.headers["content-type"] == "application/json"
    r = HTTP.get(stack.gateway.url + "/readyz")
    # The fields probes read stay; each engine's health and reason are added, by index.
    assert (r.status_code, r.json()) == (
        200,
        {
            "status": "ready",
            "healthy_engines": 1,
            "engines": 1,
            "engine_states": [{"index": 0, "healthy": True, "reason": None}],
        },
    )
    # A key that is presented does not matter there, even one that is not valid.
    r = HTTP.get(stack.gateway.url + "/healthz", headers={"Authorization": f"Bearer {WRONG}"})
    assert r.status_code == 200


@pytest.mark.slow
def test_metrics_keep_their_scope_and_format(stack: Stack) -> None:
    r = HTTP.get(stack.gateway.url + "/metrics", headers=auth(ADMIN))
    assert (r.status_code, error_code(r)) == (403, "scope_not_allowed")
    r = HTTP.get(stack.gateway.url + "/metrics", headers=auth(METRICS))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE gateway_requests_total counter" in r.text
