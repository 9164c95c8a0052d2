"""The shared placement store's settings (gateway/routing/store.py), in process."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.routing.settings import RoutingSettings
from gateway.routing.store import PlacementStore, redacted


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@10.0.0.5:6379/0", "redis://10.0.0.5:6379/0"),
        ("rediss://user:pw@redis.example:6380", "rediss://redis.example:6380"),
        ("redis://redis", "redis://redis"),
        ("redis://:pw@[fd00::5]:6379/2", "redis://[fd00::5]:6379/2"),
        ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock"),
    ],
)
def test_the_store_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redacted(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw@127.0.0.1:6379/0?socket_timeout=abc",
        "unix:///run/redis.sock?db=x&password=pw",
        "redis://127.0.0.1/0?max_connections=many",
    ],
)
def test_a_url_the_store_cannot_read_is_refused_with_the_settings(url: str) -> None:
    """Whatever the store's client refuses when the app is built is refused when the
    settings load (so `serve --workers N` refuses it before a worker starts), and the
    message quotes nothing of the URL."""
    with pytest.raises(ValidationError) as info:
        RoutingSettings(store_url=url)
    message = " ".join(error["msg"] for error in info.value.errors())
    assert "store_url" in str(info.value) and "pw" not in message and "abc" not in message
    for ok in ("redis://:pw@127.0.0.1:6379/0?socket_timeout=0.5", "unix:///run/redis.sock?db=2"):
        assert PlacementStore(RoutingSettings(store_url=ok)).where
