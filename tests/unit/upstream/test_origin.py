"""An engine URL parsed once (gateway/upstream/client.py's Origin)."""

from __future__ import annotations

import pytest

from gateway.upstream.origin import Origin


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8000", ("127.0.0.1", 8000, False, b"127.0.0.1:8000", "")),
        ("http://engine/", ("engine", 80, False, b"engine", "")),
        ("https://engine.svc:8443/vllm/", ("engine.svc", 8443, True, b"engine.svc:8443", "/vllm")),
        ("http://[::1]:9000", ("::1", 9000, False, b"[::1]:9000", "")),
    ],
)
def test_origin_of_an_engine_url(url: str, expected: tuple[object, ...]) -> None:
    o = Origin(url)
    assert (o.host, o.port, o.ssl, o.host_header, o.base_path) == expected


@pytest.mark.parametrize("url", ["ftp://engine", "engine:8000", "http://", "unix:///tmp/x"])
def test_unusable_engine_urls(url: str) -> None:
    with pytest.raises(ValueError):
        Origin(url)
