"""`vllm-gateway` check-config and hash-key (in-process: they only read settings)."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.auth import hash_key
from gateway.cli import main
from tests.procs import Proc, gateway_proc, run_cli, running, wait_for

SECRET = "sk-cli-secret-0123456789abcdef"
UPSTREAM = "upstream-secret-0123456789"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GATEWAY_") or name == "VLLM_GATEWAY_CONFIG":
            monkeypatch.delenv(name)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


MASK = "**********"  # how pydantic dumps a SecretStr


def test_check_config_masks_every_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "engines: [http://127.0.0.1:8001]\n"
        f"api_keys:\n  - {SECRET}\n"
        f"  - key: {SECRET}x\n    name: tenant-a\n    scopes: [inference]\n"
        f"upstream_api_key: {UPSTREAM}\n"
    )
    monkeypatch.setenv("GATEWAY_PORT", "9123")
    code, out, err = run(capsys, "check-config", "--config", str(config))
    assert code == 0, err
    data = json.loads(out)
    assert data["port"] == 9123  # the environment overrides the file
    assert data["engines"] == ["http://127.0.0.1:8001"]
    # Masked by their types (SecretStr), not by the command.
    assert data["api_keys"][0] == MASK
    assert data["api_keys"][1] == {
        "key": MASK, "name": "tenant-a", "scopes": ["inference"], "models": None, "tenant": None,
        "max_in_flight": None, "rate": None,
    }  # fmt: skip
    assert data["upstream_api_key"] == MASK
    assert SECRET not in out + err and UPSTREAM not in out + err


def test_check_config_masks_keys_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_API_KEYS", json.dumps([SECRET, {"key": SECRET + "y"}]))
    monkeypatch.setenv("GATEWAY_UPSTREAM_API_KEY", UPSTREAM)
    code, out, err = run(capsys, "check-config")
    assert code == 0, err
    data = json.loads(out)
    assert data["api_keys"][0] == data["api_keys"][1]["key"] == data["upstream_api_key"] == MASK
    assert SECRET not in out + err and UPSTREAM not in out + err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "no API keys configured"),
        ({"GATEWAY_API_KEYS": '["short"]'}, "at least 16"),
        ({"GATEWAY_API_KEYS": f'[{{"key": "{SECRET}", "scopes": 7}}]'}, "api_keys"),
        ({"GATEWAY_API_KEYS": f'["{SECRET}"]', "GATEWAY_PORT": "99999"}, "port"),
        (
            {"GATEWAY_API_KEYS": f'["{SECRET}"]', "GATEWAY_TIMEOUTS__UPSTREAM_KEEPALIVE": "6"},
            "upstream_keepalive",
        ),
        (
            {"GATEWAY_API_KEYS": f'["{SECRET}"]', "GATEWAY_MEDIA__CA_FILE": "/nonexistent.pem"},
            "ca_file",
        ),
        # A header vLLM acts on may not be added to the forwarded ones.
        (
            {"GATEWAY_API_KEYS": f'["{SECRET}"]', "GATEWAY_FORWARD_HEADERS": '["X-Vllm-Priority"]'},
            "forward_headers",
        ),
        ({"GATEWAY_API_KEYS": f'["{SECRET}"]', "GATEWAY_LIMITS__MAX_HEADERS": "0"}, "max_headers"),
    ],
)
def test_check_config_refuses_invalid_settings(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = run(capsys, "check-config")
    assert code == 2
    assert message in err
    assert SECRET not in out + err


def test_check_config_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "check-config", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "not found" in err


def test_check_config_bad_key_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- key: {SECRET}\n  scopez: [inference]\n")
    monkeypatch.setenv("GATEWAY_API_KEYS_FILE", str(keys))
    code, out, err = run(capsys, "check-config")
    assert code == 2 and "key file" in err
    assert SECRET not in out + err


def test_hash_key(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(SECRET + "\n"))
    code, out, _ = run(capsys, "hash-key")
    assert code == 0 and out.strip() == hash_key(SECRET)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = run(capsys, "hash-key")
    assert code == 2 and "no key" in err


def test_console_script_entry_point() -> None:
    # `python -m gateway.cli` is what the test harness and the docs run.
    result = run_cli("hash-key", stdin=SECRET)
    assert result.returncode == 0
    assert result.stdout.strip() == hash_key(SECRET)


def test_serve_with_a_config_file_and_two_workers(
    tmp_path: Path, start_sim: Callable[..., Proc]
) -> None:
    """The multi-worker path: uvicorn builds each worker's app from `app_from_env`."""
    sim = start_sim("--latency", "zero")
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"engines: [{sim.url}]\napi_keys: [{SECRET}]\nlog_format: console\n"
        "routing: {health_interval: 30}\n"
    )
    gw = gateway_proc(tmp_path, {}, "--config", str(config), "--workers", "2")
    with running(gw, ready_path="/healthz"):
        assert wait_for(lambda: httpx.get(gw.url + "/readyz").status_code == 200)
        for _ in range(4):
            r = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {SECRET}"})
            assert r.status_code == 200 and r.json()["data"]
        r = httpx.get(gw.url + "/v1/models")
        assert r.status_code == 401
    assert "request" in gw.log() and SECRET not in gw.log()
