"""Settings are strict at every depth, and the example configuration covers them all.

The lists of models and settings are read from the pydantic models: a new setting, or
a new settings model, fails here until it is strict and the example describes it."""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from gateway.config.settings import Settings, load_settings
from gateway.config.sources import ConfigError, environment_names, models
from tests.procs import ROOT, run_cli
from tests.procs import clean_env as child_env

EXAMPLE = ROOT / "deploy" / "gateway.example.yaml"
KEY = "sk-strict-0123456789abcdef"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("GATEWAY_"):
            monkeypatch.delenv(name)


def setenv(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("model", list(models(Settings)), ids=lambda m: m.__name__)
def test_every_settings_model_refuses_unknown_keys(model: type[BaseModel]) -> None:
    assert model.model_config.get("extra") == "forbid"


def test_every_setting_has_its_variable() -> None:
    names = environment_names(Settings)
    assert names["GATEWAY_ENGINES"] == ("engines",)
    assert names["GATEWAY_MEDIA"] == ("media",)
    assert names["GATEWAY_MEDIA__ALLOWED_DOMAINS"] == ("media", "allowed_domains")
    assert names["GATEWAY_LIMITS__RATE_PER_KEY__BURST"] == ("limits", "rate_per_key", "burst")
    # A list of objects is one JSON variable, not one per entry's field.
    assert not any(name.startswith("GATEWAY_API_KEYS__") for name in names)


@pytest.mark.parametrize("name", ["GATEWAY_LIMITS__RATE_PER_KEY__BURST", "gateway_port"])
def test_the_variables_pydantic_reads_are_accepted(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    env = {
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_LIMITS__RATE_PER_KEY": '{"requests_per_second": 2}',
        name: "8",
    }
    setenv(monkeypatch, env)
    settings = load_settings()
    assert settings.limits.rate_per_key is not None
    assert 8 in (settings.limits.rate_per_key.burst, settings.port)


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"GATEWAY_MEDIA__MOD": "inline"}, "did you mean GATEWAY_MEDIA__MODE?"),
        ({"GATEWAY_XYZZY": "1"}, "GATEWAY_XYZZY: unknown setting"),
        ({"GATEWAY_ENGINES": ""}, "GATEWAY_ENGINES: not valid JSON; engines is a list"),
        ({"GATEWAY_LIMITS__RATE_PER_KEY": "{rps: 5}"}, "limits.rate_per_key is an object"),
        ({"GATEWAY_LIMITS__RATE_PER_KEY": "5"}, "RATE_PER_KEY: limits.rate_per_key:"),
    ],
)  # fmt: skip
def test_variables_that_cannot_be_read_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], line: str
) -> None:
    setenv(monkeypatch, {"GATEWAY_API_KEYS": json.dumps([KEY]), **env})
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert line in str(info.value)


def _covered(model: type[BaseModel], data: Any, found: set[tuple[str, str]]) -> None:
    """Record each (model, field) the example's `data` sets, walking nested models,
    lists of them, and unions (the member whose fields the mapping uses)."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        found.add((model.__name__, name))
        if name in model.model_fields:
            _covered_value(model.model_fields[name].annotation, value, found)


def _covered_value(annotation: Any, value: Any, found: set[tuple[str, str]]) -> None:
    for tp in _types(annotation):
        if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(value, dict):
            if set(value) <= set(tp.model_fields):
                _covered(tp, value, found)
        elif typing.get_origin(tp) is list and isinstance(value, list):
            for item in value:
                _covered_value(typing.get_args(tp)[0], item, found)


def _types(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, type(int | str)):
        return [t for a in args for t in _types(a)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _types(args[0])
    return [annotation]


def test_the_example_configuration_sets_every_setting() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    found: set[tuple[str, str]] = set()
    _covered(Settings, data, found)
    every = {(m.__name__, name) for m in models(Settings) for name in m.model_fields}
    assert sorted(every - found) == []


def test_the_example_configuration_holds_the_defaults() -> None:
    """Every value is the default but those marked EXAMPLE (engines, api_keys)."""
    example = load_settings(EXAMPLE).model_dump(mode="json")
    defaults = Settings(allow_unauthenticated=True).model_dump(mode="json")
    for name in ("engines", "api_keys", "allow_unauthenticated"):
        del example[name], defaults[name]
    assert example == defaults


@pytest.mark.slow
def test_check_config_accepts_the_example_configuration() -> None:
    result = run_cli("check-config", "--config", str(EXAMPLE), env=child_env())
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["engines"] == ["http://127.0.0.1:8001"]
    assert data["payload"]["cache_isolation"] == "off"


def test_a_settings_file_that_is_empty_is_no_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    monkeypatch.setenv("GATEWAY_ALLOW_UNAUTHENTICATED", "true")
    settings = load_settings(empty)
    assert settings.engines == []
