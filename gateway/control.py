"""The control plane: the gateway's own routes, served by a FastAPI application.

    GET /healthz                no key     the process is up (liveness probe)
    GET /readyz                 no key     an engine is healthy (readiness probe)
    GET /metrics                metrics    Prometheus text of every worker (observability/)
    GET /gateway/status         admin      engines, routing policy, key file, version
    GET /gateway/openapi.json   admin      the OpenAPI schema of these routes

Only requests the endpoint table marks `local` reach it (middleware.Front), after the
same steps as every request: keys and scopes are checked there, refusals rendered and
logged there. Forwarded requests never enter FastAPI, whose request handling cost
~200-270 us of CPU per request (docs/facts.md, "Measurements behind design choices").

The schema needs the `admin` scope like the status: it names the gateway's version,
which helps nobody but an attacker matching versions to advisories, and the tools that
read it act for an operator, who holds that key.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from gateway.access.api_keys import KeyRing
from gateway.errors import GatewayError
from gateway.exchange import exchange_of
from gateway.observability.metrics import CONTENT_TYPE, Metrics
from gateway.observability.multiprocess import MetricFiles
from gateway.responses import error_body
from gateway.routing.engine import Engine
from gateway.routing.pool import EnginePool
from gateway.types import ASGIApp, Message, Receive, Scope, Send

OPENAPI_URL = "/gateway/openapi.json"
_BEARER = "bearer"


# --- what the routes answer -----------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class EngineReadiness(BaseModel):
    index: int = Field(description="The engine's place in /gateway/status's `engines`.")
    healthy: bool
    reason: str | None = Field(
        description="Why it is not healthy (stable: connect_refused, timeout, "
        "upstream_key_refused ...; docs/gateway.md); null when healthy."
    )


class Readiness(BaseModel):
    status: Literal["ready", "no_healthy_engine"]
    healthy_engines: int = Field(description="Engines in rotation.")
    engines: int = Field(description="Engines configured (DNS entries: as last resolved).")
    engine_states: list[EngineReadiness] = Field(
        description="Each engine's health and reason, by index: no address (the probe "
        "needs no key; /gateway/status names the engines)."
    )


class EngineStatus(BaseModel):
    url: str = Field(description="Where requests go (without any user:password@ part).")
    healthy: bool = Field(
        description="In rotation: passed its last health check and is not ejected."
    )
    models: list[str] = Field(description="Models the engine lists, as last read.")
    in_flight: int = Field(description="Requests this gateway process is forwarding to it.")
    running: int | None = Field(
        description="Requests the engine is running (from every gateway process and "
        "replica), from its metrics as last scraped; null when not scraped."
    )
    waiting: int | None = Field(
        description="Requests queued in the engine, from its metrics as last scraped; "
        "null when they are not scraped (routing.load_interval 0) or not yet."
    )
    kv_cache_usage: float | None = Field(
        description="The engine's KV cache usage (0-1), scraped like `waiting`."
    )
    recomputed_tokens: float | None = Field(
        description="Prompt tokens the engine recomputed lately: its prefix cache's "
        "queries less its hits, their growth since this process first scraped them, "
        "decaying with routing.store_decay (the shared store places new anchors by it); "
        "null when not scraped or when the engine has no such counters."
    )
    ejections: int = Field(
        description="Times it was taken out of rotation by a refused connection or 5xx run."
    )
    reason: str | None = Field(
        description="Why it is not healthy, a stable string (connect_refused, timeout, "
        "upstream_key_refused ...; docs/gateway.md); null when healthy."
    )
    detail: str | None = Field(
        description="The reason for people: what the check saw (a status code, a setting "
        "to look at), never the engine's answer; null when healthy."
    )
    since: datetime = Field(description="When its health or reason last changed.")


class DnsEntryStatus(BaseModel):
    entry: str = Field(description="The `dns+http://` or `dns+https://` entry, as configured.")
    reason: str | None = Field(
        description="Why its last lookup gave no engines: dns_no_addresses (none: the "
        "entry has no engines), dns_failed (the last good addresses are kept); null: "
        "it answered."
    )
    detail: str | None


class KeyFileStatus(BaseModel):
    path: str
    loaded_at: datetime = Field(description="When the keys in force were read from it.")
    keys: int = Field(description="Keys read from it then.")
    refused_at: datetime | None = Field(
        description="When a later version of the file was refused as invalid (the keys "
        "read before stay in force; the log says why); null: none since."
    )


class KeysStatus(BaseModel):
    in_force: int = Field(description="Keys accepted now: from settings and the key file.")
    file: KeyFileStatus | None = Field(description="The key file; null: none configured.")


class ProcessStatus(BaseModel):
    pid: int = Field(description="The process that answered.")
    workers: int = Field(description="Worker processes of this gateway (serve --workers).")
    view: Literal["this_process", "all_workers"] = Field(
        description="Whom the answer covers: `this_process` (the worker that answered; "
        "each worker has its own engines' view, keys and counts) or `all_workers`."
    )


class GatewayStatus(BaseModel):
    """The state of this gateway process (each worker answers for itself: `process`)."""

    process: ProcessStatus
    version: str
    policy: str = Field(description="The routing policy (routing.policy).")
    ready: bool = Field(description="What /readyz says: some engine is healthy.")
    engines: list[EngineStatus]
    dns_entries: list[DnsEntryStatus] = Field(description="The DNS entries of `engines`.")
    keys: KeysStatus


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str = Field(description="Stable: invalid_api_key (401), scope_not_allowed (403).")


class ErrorBody(BaseModel):
    error: ErrorDetail


# --- where the answers come from ------------------------------------------------------


class KeyFile(Protocol):
    """The key file's state, as the watcher that reloads it keeps it (app.py)."""

    path: Path
    # time.time() of the last good load, keys read then, and of the last refusal.
    loaded_at: float
    loaded_keys: int
    refused_at: float | None


def engine_status(engine: Engine) -> EngineStatus:
    """One engine as /gateway/status shows it: the one place to add what the pool
    learns of an engine."""
    return EngineStatus(
        url=engine.public_url,
        healthy=engine.healthy,
        models=sorted(engine.models),
        in_flight=engine.in_flight,
        running=engine.running if engine.scraped else None,
        waiting=engine.waiting if engine.scraped else None,
        kv_cache_usage=engine.kv_cache_usage if engine.scraped else None,
        recomputed_tokens=(
            round(engine.recomputed.value(time.monotonic()), 1) if engine.recomputed.known else None
        ),
        ejections=engine.ejections,
        reason=engine.reason,
        detail=engine.detail,
        since=datetime.fromtimestamp(engine.since, UTC),
    )


def _when(stamp: float | None) -> datetime | None:
    return None if stamp is None else datetime.fromtimestamp(stamp, UTC)


def key_file_status(key_file: KeyFile) -> KeyFileStatus:
    loaded_at = _when(key_file.loaded_at)
    assert loaded_at is not None
    return KeyFileStatus(
        path=str(key_file.path),
        loaded_at=loaded_at,
        keys=key_file.loaded_keys,
        refused_at=_when(key_file.refused_at),
    )


def gateway_version() -> str:
    try:
        return version("vllm-gateway")
    except PackageNotFoundError:
        # Run from a source tree that was never installed.
        return "unknown"


# --- the application ------------------------------------------------------------------


class _ControlApp(FastAPI):
    """FastAPI with the bearer scheme the gateway's middleware checks, in the schema."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            components = schema.setdefault("components", {})
            components["securitySchemes"] = {
                _BEARER: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A gateway key, with the scope the route names.",
                }
            }
        assert self.openapi_schema is not None
        return self.openapi_schema


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette's last-resort handler: the gateway's 500 body (responses.error_body, the
    # bytes send_error writes) instead of its plain text; the exception goes on to
    # middleware.Front, which logs it.
    error = GatewayError()
    return Response(error_body(error), status_code=error.status, media_type="application/json")


def _keyed(scope: str, responses: dict[int | str, Any] | None = None) -> dict[str, Any]:
    """Schema details of a route that needs a key with `scope`, its `responses` added."""
    return {
        "openapi_extra": {"security": [{_BEARER: []}]},
        "responses": {
            **(responses or {}),
            401: {"model": ErrorBody, "description": "No key, or not a valid one."},
            403: {"model": ErrorBody, "description": f"The key has no `{scope}` scope."},
        },
    }


def control_app(
    pool: EnginePool,
    metrics: Metrics,
    keyring: KeyRing,
    *,
    policy: str,
    key_file: KeyFile | None,
    public_metrics: bool,
    workers: int,
    metric_files: MetricFiles | None,
) -> ASGIApp:
    """The control routes over `pool`, `metrics`, the keys in force (`keyring`) and
    the `key_file` they were read from, if any; `policy` is the routing policy's name.
    This process is one of `workers`; with `metric_files`, /metrics merges theirs."""
    gateway = gateway_version()
    app = _ControlApp(
        title="vllm-gateway control plane",
        version=gateway,
        summary="The gateway's own routes. The forwarded API is vLLM's and is not described.",
        openapi_url=OPENAPI_URL,
        docs_url=None,
        redoc_url=None,
        exception_handlers={Exception: _internal_error},
    )

    @app.get("/healthz", response_model=Health, summary="Liveness: the process is up.")
    async def healthz() -> Health:
        return Health()

    @app.get(
        "/readyz",
        response_model=Readiness,
        summary="Readiness: some engine is healthy (503 when none is).",
        responses={503: {"model": Readiness, "description": "No engine is healthy."}},
    )
    async def readyz() -> Response:
        # Ready: some engine is healthy, which the pool grants only once that engine's
        # served models are known (one that answered before knowing them would refuse
        # served models as unknown).
        ready = pool.ready()
        body = Readiness(
            status="ready" if ready else "no_healthy_engine",
            healthy_engines=len(pool.healthy()),
            engines=len(pool.engines),
            engine_states=[
                EngineReadiness(index=i, healthy=e.healthy, reason=e.reason)
                for i, e in enumerate(pool.engines)
            ],
        )
        return JSONResponse(body.model_dump(), status_code=200 if ready else 503)

    metrics_type = CONTENT_TYPE.decode("latin-1")
    text: dict[int | str, Any] = {
        200: {"description": "Prometheus text.", "content": {metrics_type: {"schema": {}}}}
    }

    @app.get(
        "/metrics",
        summary="The gateway's Prometheus metrics (`metrics` scope, unless public_metrics).",
        response_class=Response,
        **({"responses": text} if public_metrics else _keyed("metrics", text)),
    )
    async def prometheus() -> Response:
        if metric_files is None:
            return Response(metrics.render(), media_type=metrics_type)
        return Response(await metric_files.render(), media_type=metrics_type)

    @app.get(
        "/gateway/status",
        response_model=GatewayStatus,
        summary="Engines, routing policy, key file and version, as the worker that "
        "answered sees them (`admin` scope).",
        **_keyed("admin"),
    )
    async def status() -> GatewayStatus:
        return GatewayStatus(
            process=ProcessStatus(pid=os.getpid(), workers=workers, view="this_process"),
            version=gateway,
            policy=policy,
            ready=pool.ready(),
            engines=[engine_status(e) for e in pool.engines],
            dns_entries=[
                DnsEntryStatus(
                    entry=entry,
                    reason=None if v is None else v.reason,
                    detail=None if v is None else v.detail,
                )
                for entry, v in pool.dns_reasons.items()
            ],
            keys=KeysStatus(
                in_force=len(keyring.keys),
                file=None if key_file is None else key_file_status(key_file),
            ),
        )

    return ControlPlane(app)


class ControlPlane:
    """The control application as the gateway runs it: each answer's size goes on the
    request's exchange, for the log line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex = exchange_of(scope)

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.body":
                ex.bytes_out += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, counted)
