"""The engine's own key (`upstream_api_key`), built once for the proxy and the pool."""

from __future__ import annotations

from pydantic import SecretStr

from gateway.app import engine_auth_headers


def test_no_key_sends_no_authorization() -> None:
    assert engine_auth_headers(None) == []


def test_the_key_goes_as_a_bearer_authorization() -> None:
    assert engine_auth_headers(SecretStr("sk-engine")) == [(b"authorization", b"Bearer sk-engine")]
