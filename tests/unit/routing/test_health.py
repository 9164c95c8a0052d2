"""Why an engine is down (gateway/routing/health.py) as tables. Through running
gateways: tests/e2e/test_engine_health.py."""

from __future__ import annotations

import pytest

from gateway.routing.health import error_verdict, status_verdict, unreadable_models
from gateway.upstream.errors import (
    ClosedUnanswered,
    ConnectFailed,
    ConnectRefused,
    ConnectTimeout,
    FirstByteTimeout,
    NameUnresolved,
    ReadTimeout,
    TlsFailed,
    UpstreamError,
)
from tests.e2e.test_engine_health import GARBAGE


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ConnectRefused("connect"), "connect_refused"),
        (ConnectTimeout("connect"), "connect_timeout"),
        (NameUnresolved("connect"), "name_unresolved"),
        (TlsFailed("connect"), "tls_failed"),
        (ConnectFailed("connect"), "connect_failed"),
        (TimeoutError(), "timeout"),
        (FirstByteTimeout("timeout"), "timeout"),
        (ReadTimeout("timeout"), "timeout"),
        (ClosedUnanswered("closed"), "bad_response"),
    ],
)
def test_error_reasons(error: UpstreamError | TimeoutError, reason: str) -> None:
    verdict = error_verdict(error, "/health", 1.0)
    assert verdict.reason == reason and verdict.detail


@pytest.mark.parametrize(
    ("path", "status", "keyed", "reason", "words"),
    [
        ("/health", 503, True, "health_status", "GET /health answered 503"),
        ("/v1/models", 500, True, "models_status", "GET /v1/models answered 500"),
        ("/v1/models", 401, True, "upstream_key_refused", "is not the key the engine was"),
        ("/v1/models", 403, True, "upstream_key_refused", "upstream_api_key"),
        ("/v1/models", 401, False, "upstream_key_refused", "upstream_api_key is not set"),
        ("/health", 401, False, "upstream_key_refused", "GET /health answered 401"),
    ],
)
def test_status_reasons(path: str, status: int, keyed: bool, reason: str, words: str) -> None:
    verdict = status_verdict(path, status, keyed=keyed)
    assert verdict.reason == reason and words in verdict.detail


@pytest.mark.parametrize(
    ("body", "words"),
    [(GARBAGE, "not JSON"), (b"", "not JSON"), (b"[1, 2]", "no `data` list"), (b"{}", "no `data`")],
)
def test_unreadable_model_lists(body: bytes, words: str) -> None:
    verdict = unreadable_models(body)
    assert verdict.reason == "models_unreadable" and words in verdict.detail
    assert "GARBAGE" not in verdict.detail
