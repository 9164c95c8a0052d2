"""The shared store's settings (top-level `store_*`, their `routing.store_*` aliases and
the limits' `*_when_store_down`) and the URL as logs show it, in process, as tables."""

from __future__ import annotations

import os
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config.settings import Settings, load_settings
from gateway.config.sources import ConfigError
from gateway.routing.settings import RoutingSettings
from gateway.store.client import StoreClient, redacted

KEY = "sk-store-settings-0123456789abcdef"
URL = "redis://:pw-one@127.0.0.1:6379/0"
OTHER = "redis://:pw-two@127.0.0.1:6380/0"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("GATEWAY_"):
            monkeypatch.delenv(name)


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


@pytest.mark.parametrize("where", ["top", "routing"])
@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw@127.0.0.1:6379/0?socket_timeout=abc",
        "unix:///run/redis.sock?db=x&password=pw",
        "redis://127.0.0.1/0?max_connections=many",
        "http://:pw@127.0.0.1:6379",
        "redis://:pw@/0",
    ],
)
def test_a_url_the_store_cannot_read_is_refused_with_the_settings(url: str, where: str) -> None:
    """Whatever the store's client refuses when the app is built is refused when the
    settings load (so `serve --workers N` refuses it before a worker starts), in either
    place, and the message quotes nothing of the URL."""
    given: dict[str, Any] = (
        {"store_url": url} if where == "top" else {"routing": {"store_url": url}}
    )
    with pytest.raises(ValidationError) as info:
        Settings(api_keys=[KEY], **given)
    message = " ".join(error["msg"] for error in info.value.errors())
    assert "store_url" in str(info.value) and "pw" not in message and "abc" not in message


@pytest.mark.parametrize(
    "url", ["redis://:pw@127.0.0.1:6379/0?socket_timeout=0.5", "unix:///r.sock?db=2"]
)
def test_a_url_the_store_can_read_builds_its_client(url: str) -> None:
    settings = Settings(api_keys=[KEY], store_url=url)
    assert settings.store_url is not None
    client = StoreClient(settings.store_url.get_secret_value(), prefix="p", timeout=0.1, retry=1.0)
    assert "pw" not in client.where and client.up


# (top-level given, routing given) -> the top-level values in force, or the error's words.
ALIASES: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any] | str]] = [
    ({}, {}, {"store_url": None, "store_prefix": "vllm-gateway", "store_timeout": 0.2,
              "store_retry": 1.0}),
    ({"store_url": URL}, {}, {"store_url": URL}),
    # The old names alone: what they say is in force.
    ({}, {"store_url": URL, "store_prefix": "old", "store_timeout": 0.05, "store_retry": 3},
     {"store_url": URL, "store_prefix": "old", "store_timeout": 0.05, "store_retry": 3.0}),
    # Both places, the same value: accepted.
    ({"store_url": URL, "store_timeout": 0.5}, {"store_url": URL, "store_timeout": 0.5},
     {"store_url": URL, "store_timeout": 0.5}),
    # Both places, different values: refused, naming both.
    ({"store_url": URL}, {"store_url": OTHER}, "store_url and routing.store_url"),
    ({"store_prefix": "a"}, {"store_prefix": "b"}, "store_prefix and routing.store_prefix"),
    # A top-level value given as its default still differs from the alias's.
    ({"store_retry": 1.0}, {"store_retry": 2.0}, "store_retry and routing.store_retry"),
    ({"store_timeout": 0.2}, {"store_timeout": 0.3}, "store_timeout and routing.store_timeout"),
]  # fmt: skip


@pytest.mark.parametrize(("top", "routing", "expected"), ALIASES)
def test_routing_store_settings_are_aliases_of_the_top_level_ones(
    top: dict[str, Any], routing: dict[str, Any], expected: dict[str, Any] | str
) -> None:
    if isinstance(expected, str):
        with pytest.raises(ValidationError) as info:
            Settings(api_keys=[KEY], routing=routing, **top)
        assert expected in str(info.value)
        assert "pw-one" not in str(info.value) and "pw-two" not in str(info.value)
        return
    settings = Settings(api_keys=[KEY], routing=routing, **top)
    for name, value in expected.items():
        got = getattr(settings, name)
        if name == "store_url" and got is not None:
            got = got.get_secret_value()
        assert got == value, name


def test_both_names_from_the_environment_are_one_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_API_KEYS", f'["{KEY}"]')
    monkeypatch.setenv("GATEWAY_STORE_URL", URL)
    monkeypatch.setenv("GATEWAY_ROUTING__STORE_URL", OTHER)
    with pytest.raises(ConfigError) as info:
        load_settings()
    (line,) = str(info.value).splitlines()
    assert "store_url and routing.store_url" in line and "pw-" not in line
    monkeypatch.setenv("GATEWAY_ROUTING__STORE_URL", URL)
    assert load_settings().store_url is not None
    monkeypatch.delenv("GATEWAY_STORE_URL")
    settings = load_settings()
    assert settings.store_url is not None and settings.store_url.get_secret_value() == URL


def test_the_routing_aliases_default_to_unset() -> None:
    for name in ("store_url", "store_prefix", "store_timeout", "store_retry"):
        assert getattr(RoutingSettings(), name) is None


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({}, ("local", "local")),
        ({"rate_when_store_down": "refuse"}, ("refuse", "local")),
        ({"in_flight_when_store_down": "refuse"}, ("local", "refuse")),
        ({"rate_when_store_down": "open"}, None),
        ({"in_flight_when_store_down": "closed"}, None),
        ({"rate_when_store_down": None}, None),
    ],
)
def test_what_a_shared_limit_does_while_the_store_is_down(
    limits: dict[str, Any], expected: tuple[str, str] | None
) -> None:
    if expected is None:
        with pytest.raises(ValidationError):
            Settings(api_keys=[KEY], limits=limits)
        return
    got = Settings(api_keys=[KEY], limits=limits).limits
    assert (got.rate_when_store_down, got.in_flight_when_store_down) == expected
