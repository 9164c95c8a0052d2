"""`vllm-gateway` serve, check-config and hash-key, run as an operator runs them (a
subprocess each: the commands configure the process's logging)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.harness.metrics import HTTP
from gateway.cli import parser
from gateway.config.key_file import hash_key
from tests.procs import (
    ROOT,
    Proc,
    clean_env,
    every_worker_lists,
    free_port,
    gateway_proc,
    run_cli,
    running,
    wait_for,
)

SECRET = "sk-cli-secret-0123456789abcdef"
UPSTREAM = "upstream-secret-0123456789"
# An engine nothing listens on: enough for the settings, and for `serve` to start.
ENGINES = json.dumps(["http://127.0.0.1:9"])


def check_config(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`vllm-gateway check-config` in a subprocess, with only the given GATEWAY_ variables."""
    result = run_cli("check-config", *argv, env=clean_env(env))
    return result.returncode, result.stdout, result.stderr


MASK = "**********"  # how pydantic dumps a SecretStr


@pytest.mark.slow
def test_check_config_masks_every_secret(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "engines: [http://127.0.0.1:8001]\n"
        f"api_keys:\n  - {SECRET}\n"
        f"  - key: {SECRET}x\n    name: tenant-a\n    scopes: [inference]\n"
        f"upstream_api_key: {UPSTREAM}\n"
    )
    code, out, err = check_config("--config", str(config), env={"GATEWAY_PORT": "9123"})
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


@pytest.mark.slow
def test_check_config_masks_keys_from_the_environment() -> None:
    env = {
        "GATEWAY_API_KEYS": json.dumps([SECRET, {"key": SECRET + "y"}]),
        "GATEWAY_UPSTREAM_API_KEY": UPSTREAM,
        "GATEWAY_ENGINES": ENGINES,
    }
    code, out, err = check_config(env=env)
    assert code == 0, err
    data = json.loads(out)
    assert data["api_keys"][0] == data["api_keys"][1]["key"] == data["upstream_api_key"] == MASK
    assert SECRET not in out + err and UPSTREAM not in out + err


@pytest.mark.slow
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
def test_check_config_refuses_invalid_settings(env: dict[str, str], message: str) -> None:
    code, out, err = check_config(env=env)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert SECRET not in out + err


@pytest.mark.slow
def test_check_config_missing_file(tmp_path: Path) -> None:
    code, _, err = check_config("--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "not found" in err


@pytest.mark.slow
def test_check_config_bad_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- key: {SECRET}\n  scopez: [inference]\n")
    code, out, err = check_config(env={"GATEWAY_API_KEYS_FILE": str(keys)})
    assert code == 2 and "key file" in err
    assert SECRET not in out + err


@pytest.mark.slow
def test_hash_key() -> None:
    result = run_cli("hash-key", stdin="")
    assert result.returncode == 2 and "no key" in result.stderr


@pytest.mark.slow
def test_console_script_entry_point() -> None:
    # `python -m gateway.cli` is what the test harness and the docs run.
    result = run_cli("hash-key", stdin=SECRET)
    assert result.returncode == 0
    assert result.stdout.strip() == hash_key(SECRET)


@pytest.mark.slow
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
        assert wait_for(lambda: HTTP.get(gw.url + "/readyz").status_code == 200)
        for _ in range(4):
            r = HTTP.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {SECRET}"})
            assert r.status_code == 200 and r.json()["data"]
        r = HTTP.get(gw.url + "/v1/models")
        assert r.status_code == 401
    assert "request" in gw.log() and SECRET not in gw.log()


@pytest.mark.parametrize(
    "store_url",
    ["redis://127.0.0.1:9/0?socket_timeout=abc", "unix:///tmp/none.sock?db=x"],
)
@pytest.mark.slow
def test_serve_with_workers_refuses_what_a_worker_would_refuse(store_url: str) -> None:
    """`serve --workers N` starts no worker with settings a worker's app would refuse:
    the parent exits with one line, as with one worker (a store URL whose query redis
    cannot read was refused only when the app was built: each worker died with a
    traceback and the parent kept the port)."""
    env = {
        "GATEWAY_ENGINES": '["http://127.0.0.1:9"]',
        "GATEWAY_API_KEYS": f'["{SECRET}"]',
        "GATEWAY_ROUTING__STORE_URL": store_url,
    }
    result = run_cli("serve", "--port", "0", "--workers", "2", env=clean_env(env))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "store_url" in result.stderr or "invalid settings" in result.stderr
    assert "Traceback" not in result.stderr and "abc" not in result.stderr


@pytest.mark.slow
def test_workers_share_one_generated_namespace_secret(
    tmp_path: Path, start_sim: Callable[..., Proc]
) -> None:
    """Without `payload.namespace_secret`, `serve --workers 2` generates one for all its
    workers: a request id (and so a stored response's id, which each worker checks on
    retrieval) reads the same whichever worker took the request. Each request goes on a
    new connection, so the kernel hands them to both workers."""
    sim = start_sim("--latency", "zero", "--record-requests", "100")
    env = {"GATEWAY_ENGINES": json.dumps([sim.url]), "GATEWAY_API_KEYS": json.dumps([SECRET])}
    gw = gateway_proc(tmp_path, env, "--workers", "2")
    headers = {"Authorization": f"Bearer {SECRET}", "Connection": "close"}
    with running(gw, ready_path="/healthz"):
        assert wait_for(lambda: every_worker_lists(gw, 2, "Qwen/Qwen3-VL-2B-Instruct", headers))
        body = {"model": "Qwen/Qwen3-VL-2B-Instruct", "prompt": "x", "max_tokens": 1}
        for _ in range(20):
            r = HTTP.post(
                gw.url + "/v1/completions", json={**body, "request_id": "mine"}, headers=headers
            )
            assert r.status_code == 200
        sent = HTTP.get(sim.url + "/sim/requests").json()
    ids = {json.loads(e["body"])["request_id"] for e in sent if e["path"] == "/v1/completions"}
    assert len(ids) == 1


def _subcommand(name: str) -> argparse.ArgumentParser:
    for action in parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices[name]
            return sub
    raise AssertionError(name)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_help_describes_every_option_with_its_default(command: str) -> None:
    options = [a for a in _subcommand(command)._actions if a.dest != "help"]
    assert options
    for action in options:
        assert action.help and "default" in action.help, action.option_strings
    result = run_cli(command, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for action in options:
        assert action.option_strings[0] in text
    # The variables an operator sets first, and how nesting and lists are written.
    for name in ("GATEWAY_ENGINES", "GATEWAY_API_KEYS", "GATEWAY_<SECTION>__<NAME>", "JSON"):
        assert name in text
    assert "deploy/gateway.example.yaml" in text


@pytest.mark.slow
def test_sim_help_describes_every_option_with_its_default() -> None:
    from bench.sim.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    result = subprocess.run(
        [sys.executable, "-m", "bench.sim", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0
    entries = result.stdout.split("options:", 1)[1]
    # One entry per option: its flags on a line of their own or followed by the help.
    blocks = [b for b in entries.split("\n  -") if b.strip() and not b.startswith("h, --help")]
    assert len(blocks) >= 14
    for block in blocks:
        assert "(default:" in " ".join(block.split()), block


@pytest.mark.slow
def test_serve_logs_where_it_listens(tmp_path: Path) -> None:
    """One line at start: the bound address (port 0: the one chosen), the engines,
    the policy and the media mode. (An engine URL with credentials is refused:
    test_config_errors.py.)"""
    env = clean_env(
        {
            "GATEWAY_API_KEYS": json.dumps([SECRET]),
            "GATEWAY_ENGINES": json.dumps(["http://127.0.0.1:9/vllm"]),
            "GATEWAY_ROUTING__POLICY": "round_robin",
            "GATEWAY_MEDIA__MODE": "data_only",
        }
    )
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", "0"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        line = None
        deadline = time.monotonic() + 60
        while line is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            for raw in log.read_text().splitlines():
                if '"gateway_serving"' in raw:
                    line = json.loads(raw)
        assert line is not None, log.read_text()
        assert line["policy"] == "round_robin" and line["media_mode"] == "data_only"
        assert line["engines"] == ["http://127.0.0.1:9/vllm"]
        (listen,) = line["listen"]
        assert listen.startswith("http://127.0.0.1:") and not listen.endswith(":0")
        assert HTTP.get(listen + "/healthz").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert SECRET not in log.read_text()


@contextmanager
def socket_bound() -> Iterator[int]:
    """A loopback port held by a listening socket."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_exits_with_a_line_when_the_port_is_taken(workers: str) -> None:
    """The gateway's own configuration line and exit code 2, before anything starts: no
    `gateway_started` line, no uvicorn line."""
    env = clean_env({"GATEWAY_API_KEYS": json.dumps([SECRET]), "GATEWAY_ENGINES": ENGINES})
    with socket_bound() as port:
        result = run_cli("serve", "--port", str(port), "--workers", workers, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"vllm-gateway: cannot listen on 127.0.0.1:{port}: the port is in use by another "
        "process (choose another with --port, GATEWAY_PORT or `port`, or stop the other)"
    ]
