"""Operator options and small refusal cases, in-process (no engine is ever needed: every
case here is answered by the gateway before forwarding)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
import structlog

from gateway.access.admission import Admission
from gateway.app import create_app
from gateway.config.settings import LimitsSettings, Settings
from gateway.middleware import RequestIds
from gateway.observability.logging import RequestLog, configure_logging, redact
from gateway.observability.metrics import Metrics

KEY = "sk-options-0123456789abcdef"


def settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {"engines": ["http://127.0.0.1:9"], "api_keys": [KEY]}
    return Settings(**{**base, **overrides})


async def call(s: Settings, method: str, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_app(s))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.request(method, path, **kwargs)


def run(s: Settings, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return asyncio.run(call(s, method, path, **kwargs))


@pytest.mark.parametrize(
    ("options", "method", "path", "headers", "status", "code"),
    [
        ({}, "GET", "/metrics", {}, 401, "invalid_api_key"),
        ({"public_metrics": True}, "GET", "/metrics", {}, 200, None),
        # Without a key, allowed only by allow_unauthenticated (the body check then runs).
        ({}, "POST", "/v1/chat/completions", {}, 401, "invalid_api_key"),
        ({"allow_unauthenticated": True}, "POST", "/v1/chat/completions", {}, 400, "invalid_json"),
        # Anonymous callers never get the metrics scope.
        ({"api_keys": [], "allow_unauthenticated": True}, "GET", "/metrics", {}, 403,
         "scope_not_allowed"),
        # Wrong methods never reach an engine.
        ({}, "GET", "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}, 405,
         "method_not_allowed"),
        ({}, "DELETE", "/v1/models", {"Authorization": f"Bearer {KEY}"}, 405,
         "method_not_allowed"),
        ({}, "POST", "/healthz", {}, 405, "method_not_allowed"),
        # A key header in another scheme is not accepted.
        ({}, "GET", "/v1/models", {"Authorization": f"Basic {KEY}"}, 401, "invalid_api_key"),
        ({}, "GET", "/v1/models", {"X-Api-Key": KEY}, 401, "invalid_api_key"),
    ],
)  # fmt: skip
def test_options_and_refusals(
    options: dict[str, Any],
    method: str,
    path: str,
    headers: dict[str, str],
    status: int,
    code: str | None,
) -> None:
    headers = {**headers, "Content-Type": "application/json"}
    r = run(settings(**options), method, path, headers=headers, content=b"{bad")
    assert r.status_code == status
    if code is None:
        assert "gateway_requests_total" in r.text
    else:
        assert r.json()["error"]["code"] == code
        assert KEY not in r.text
    assert len(r.headers["x-request-id"]) == 32


def test_no_keys_refuses_to_start() -> None:
    with pytest.raises(ValueError, match="no API keys configured"):
        Settings(engines=["http://127.0.0.1:9"])


def test_no_engine_configured_is_503() -> None:
    r = run(
        settings(engines=[], served_models=["m"]),
        "POST",
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "m"},
    )
    assert (r.status_code, r.json()["error"]["code"]) == (503, "no_engine_available")


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        ({"authorization": "Bearer x", "event": "e"}, {"authorization": "***", "event": "e"}),
        ({"api_key": "k", "upstream_token": "t"}, {"api_key": "***", "upstream_token": "***"}),
        (
            {"url": "see data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB tail"},
            {"url": "see data:<redacted> tail"},
        ),
        ({"key_name": "tenant-a", "status": 200}, {"key_name": "tenant-a", "status": 200}),
    ],
)
def test_log_redaction(event: dict[str, Any], expected: dict[str, Any]) -> None:
    assert redact(None, "info", dict(event)) == expected


REQUEST_FIELDS: dict[str, Any] = {
    "request_id": "r-1",
    "key_name": "tenant-a",
    "client": "203.0.113.7",
    "method": "POST",
    "path": "/v1/x/data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB/y",
    "group": "inference",
    "model": None,
    "engine": "http://127.0.0.1:9",
    "status": 200,
    "code": None,
    "bytes_in": 116,
    "bytes_out": 612,
    "ttfb_ms": 0.5,
    "duration_ms": 0.75,
}


@pytest.mark.parametrize("level", ["debug", "info"])
def test_request_line_is_the_structlog_line(
    capsysbinary: pytest.CaptureFixture[bytes], level: Any
) -> None:
    """The request line rendered without structlog has the pipeline's fields, order,
    level, timestamp format and redaction."""
    configure_logging("json", level)
    try:
        logger = structlog.get_logger("gateway")
        logger.info("request", **REQUEST_FIELDS)
        RequestLog(logger, "json", level).write(dict(REQUEST_FIELDS))
    finally:
        structlog.reset_defaults()
    lines = capsysbinary.readouterr().out.splitlines()
    assert len(lines) == 2
    via_structlog, direct = (orjson.loads(line) for line in lines)
    assert list(direct) == list(via_structlog)
    assert "data:<redacted>" in direct["path"] and "iVBOR" not in direct["path"]
    for line in (via_structlog, direct):
        stamp = line.pop("timestamp")
        assert stamp.endswith("Z") and stamp[10] == "T"
    assert direct == via_structlog


def test_request_line_follows_level_and_format(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    configure_logging("console", "info")
    try:
        logger = structlog.get_logger("gateway")
        RequestLog(logger, "json", "warning").write(dict(REQUEST_FIELDS))
        assert capsysbinary.readouterr().out == b""
        RequestLog(logger, "console", "info").write(dict(REQUEST_FIELDS))
    finally:
        structlog.reset_defaults()
    out = capsysbinary.readouterr().out
    assert b"request" in out and b"tenant-a" in out and not out.startswith(b"{")


def test_request_ids_are_distinct_128_bit_hex() -> None:
    ids = RequestIds()
    minted = [ids.new() for _ in range(1000)]  # crosses several 4 KiB refills
    assert len(set(minted)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in minted)


def test_in_flight_gauge_reads_the_admission_count() -> None:
    metrics = Metrics()
    admission = Admission(LimitsSettings(max_in_flight=4), metrics)
    admission.current = 3
    assert b"gateway_requests_in_flight 3.0" in metrics.render()
