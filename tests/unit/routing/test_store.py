"""The shared placement store's settings (gateway/routing/store.py), in process."""

from __future__ import annotations

import pytest

from gateway.routing.store import redacted


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
