"""The request headers forwarded to engines (gateway/proxy/headers.py) as tables."""

from __future__ import annotations

import json

import pytest

from gateway.config.settings import Settings, load_settings
from tests.e2e.test_headers import KEY


def _settings(**overrides: object) -> Settings:
    return Settings(engines=["http://127.0.0.1:9"], api_keys=[KEY], **overrides)


@pytest.mark.parametrize(
    "name",
    [
        "endpoint-load-metrics-format", "X-Data-Parallel-Rank", "x-vllm-priority",
        "x-vllm-anything", "X-Session-ID", "X-Amzn-SageMaker-Adapter-Identifier",
        "x-amzn-sagemaker-session-id", "x-forwarded-for", "x-forwarded-proto", "forwarded",
        "origin", "host", "content-type", "content-length", "authorization", "x-request-id",
        "connection", "transfer-encoding", "te", "upgrade", "proxy-authorization",
        "bad name", "", "a:b", "x\r\ny",
    ],
)  # fmt: skip
def test_forward_headers_refuses_what_vllm_acts_on(name: str) -> None:
    with pytest.raises(ValueError, match="forward_headers"):
        _settings(forward_headers=[name])


def test_forward_headers_are_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings(forward_headers=[" Traceparent", "tracestate", "traceparent", "X-Tenant-Trace"])
    assert s.forward_headers == ["traceparent", "tracestate", "x-tenant-trace"]
    assert _settings().forward_headers == []
    monkeypatch.setenv("GATEWAY_API_KEYS", json.dumps([KEY]))
    monkeypatch.setenv("GATEWAY_FORWARD_HEADERS", '["b3", "baggage"]')
    assert load_settings().forward_headers == ["b3", "baggage"]
    monkeypatch.setenv("GATEWAY_FORWARD_HEADERS", '["x-vllm-priority"]')
    with pytest.raises(ValueError, match="never forwarded"):
        load_settings()
