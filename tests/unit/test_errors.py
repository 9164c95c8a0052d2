"""Errors rendered in one place (gateway/errors.py), in process: the connection
protocol's raw answers and the ASGI error of an unhandled exception."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import orjson
import pytest
import structlog

from gateway.access.admission import Admission
from gateway.access.api_keys import KeyRing
from gateway.config.settings import LimitsSettings
from gateway.errors import GatewayError, HeadersTooLarge
from gateway.middleware import Front
from gateway.observability.logging import RequestLog, configure_logging
from gateway.observability.metrics import Metrics
from gateway.responses import raw_response


def test_unhandled_error_logs_its_traceback_and_tells_the_client_nothing(
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    secret_text = "internal detail 0x7f00deadbeef at /srv/gateway/state"

    async def broken_handler(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError(secret_text)

    async def call() -> httpx.Response:
        logger = structlog.get_logger("gateway")
        metrics = Metrics()
        app = Front(
            proxy=broken_handler,
            local=broken_handler,
            models=broken_handler,
            metrics=metrics,
            logger=logger,
            request_log=RequestLog(logger, "json", "info"),
            max_headers=LimitsSettings().max_headers,
            keyring=KeyRing((), allow_unauthenticated=True),
            admission=Admission(LimitsSettings(), metrics),
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get("/v1/models", headers={"X-Request-Id": "req-tb-1"})

    configure_logging("json", "info")
    try:
        r = asyncio.run(call())
    finally:
        structlog.reset_defaults()
    assert r.status_code == 500
    assert r.json()["error"]["code"] == GatewayError.code == "internal_error"
    assert secret_text not in r.text and "RuntimeError" not in r.text
    lines = [orjson.loads(x) for x in capsysbinary.readouterr().out.splitlines()]
    [unhandled] = [x for x in lines if x["event"] == "unhandled_error"]
    assert unhandled["request_id"] == "req-tb-1" and unhandled["level"] == "error"
    assert unhandled["exception"].startswith("Traceback (most recent call last):")
    assert "in broken_handler" in unhandled["exception"]
    assert f"RuntimeError: {secret_text}" in unhandled["exception"]
    assert "exc_info" not in unhandled
    [request] = [x for x in lines if x["event"] == "request"]
    assert (request["status"], request["code"]) == (500, "internal_error")


def test_raw_response_is_the_rendered_error() -> None:
    raw = raw_response(HeadersTooLarge())
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert b"connection: close" in lines
    assert f"content-length: {len(body)}".encode() in lines
    assert json.loads(body)["error"]["code"] == "headers_too_large"
