"""Helpers of the real-engine tier: gateways in front of real engines, and the evidence of
what an engine received (its access log and its own counters)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness.metrics import HTTP
from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc, gateway_proc, scrape, total, wait_for

KEY = "sk-real-tier-0123456789abcdef"
# A key whose scopes leave out inference: a chat request with it is a wrong-scope refusal.
POOLING_KEY = "sk-real-pooling-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}

# Requests an engine gets that no client sent: the gateway's health checks and model
# discovery, and the tests' own scrapes.
BACKGROUND_PATHS = ("/health", "/v1/models", "/metrics")
ACCESS_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/1\.1" (\d{3})')


def gateway_env(engines: Sequence[Engine], **extra: str) -> dict[str, str]:
    keys = [
        {"key": KEY, "name": "tenant"},
        {"key": POOLING_KEY, "name": "pooling-only", "scopes": ["pooling"]},
    ]
    return {
        "GATEWAY_ENGINES": json.dumps([e.url for e in engines]),
        "GATEWAY_API_KEYS": json.dumps(keys),
        # Slow checks: every check is a line in the engine's access log.
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        **extra,
    }


@contextmanager
def gateway(tmp: Path, engines: Sequence[Engine], **extra: str) -> Iterator[Proc]:
    """A gateway in front of `engines`, ready (its engines' models known)."""
    proc = gateway_proc(tmp, gateway_env(engines, **extra))
    try:
        proc.start("/healthz", timeout=30)
        assert wait_for(lambda: HTTP.get(proc.url + "/readyz").status_code == 200, 30)
        yield proc
    finally:
        proc.stop()


def received(engine: Engine) -> list[tuple[str, str, int]]:
    """(method, path, status) of every request in the engine's access log, but for the
    background ones."""
    out = []
    for method, target, status in ACCESS_LINE.findall(engine.log()):
        path = target.split("?", 1)[0]
        if path not in BACKGROUND_PATHS:
            out.append((method, path, int(status)))
    return out


def metric(engine: Engine, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    return total(scrape(engine.url + "/metrics"), name, **labels)


@dataclass(frozen=True)
class Snapshot:
    """What an engine has seen and is doing: its access-log entries and its own counters
    (one scrape). Equal snapshots: nothing reached the engine in between."""

    requests: int
    finished: float
    prompt_tokens: float
    generated: float
    running: float

    @classmethod
    def of(cls, engine: Engine) -> Snapshot:
        samples = scrape(engine.url + "/metrics")
        return cls(
            len(received(engine)),
            total(samples, "vllm:request_success_total"),
            total(samples, "vllm:prompt_tokens_total"),
            total(samples, "vllm:generation_tokens_total"),
            total(samples, "vllm:num_requests_running"),
        )


def chat_body(model: str, content: object, **extra: object) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **extra,
    }


def raw_chat_request(body: Mapping[str, object], headers: Mapping[str, str] | None = None) -> bytes:
    """A chat request as bytes on the wire, for a client that closes its socket itself."""
    payload = json.dumps(body).encode()
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}", "", ""]
    return "\r\n".join(lines).encode() + payload


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def post(
    url: str, body: Mapping[str, object], headers: Mapping[str, str] | None = None
) -> httpx.Response:
    """A JSON POST with the tenant's key unless `headers` are given."""
    return HTTP.post(url, json=body, headers=dict(headers or AUTH), timeout=60)


# --- route drift -----------------------------------------------------------------------------

# Sample values for templated routes: the table must classify the concrete paths.
PATH_PARAMS = {"response_id": "resp_0123456789abcdef", "name": "adapter"}


def engine_routes(engine: Engine) -> dict[str, set[str]]:
    """Every route the engine serves: its OpenAPI document plus the routes it logged at
    start (the log also lists routes left out of the document, such as the docs pages)."""
    routes = {path: set(methods) for path, methods in engine.logged_routes().items()}
    spec = HTTP.get(engine.url + "/openapi.json", timeout=10).json()
    for path, operations in spec["paths"].items():
        routes.setdefault(path, set()).update(m.upper() for m in operations)
    return routes


def concrete(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PATH_PARAMS.get(m.group(1), "sample"), path)


def unclassified(engine: Engine) -> list[str]:
    """Routes the engine serves that the gateway's endpoint table does not classify."""
    from gateway.access.endpoints import Action, match

    return sorted(
        path
        for path in engine_routes(engine)
        if match(concrete(path).encode()).route.action is Action.unknown
    )
