"""Real servers on loopback for tests: subprocesses (engines, the gateway) and in-process
threaded servers (canaries and media origins) that record every connection they get.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.origin import Hit, RecordingServer, Route
from bench.stack import clean_env, terminate

__all__ = ["Hit", "RecordingServer", "Route"]

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A server subprocess on loopback. Output goes to a log file, read on failure."""

    args: list[str]
    port: int
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/health", timeout: float = 20.0) -> Proc:
        with self.log_path.open("wb") as log:
            # The child keeps its own copy of the descriptor; closing ours avoids a
            # ResourceWarning, which pytest turns into an error.
            self.popen = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited early:\n{self.log()}")
            try:
                r = httpx.get(self.url + ready_path, timeout=0.5)
                if r.status_code < 500:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.args} did not become ready:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """Stop at once, like a crashed engine."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        terminate(self.popen)


def sim_proc(tmp: Path, *opts: str, port: int | None = None) -> Proc:
    """A simulated engine (`python -m bench.sim`), not yet started."""
    port = port or free_port()
    args = [sys.executable, "-m", "bench.sim", "--host", "127.0.0.1", "--port", str(port), *opts]
    return Proc(args, port, clean_env(), tmp / f"sim-{port}.log")


def gateway_proc(tmp: Path, env: Mapping[str, str], *opts: str, port: int | None = None) -> Proc:
    """The gateway under uvicorn (`vllm-gateway serve`), not yet started."""
    port = port or free_port()
    args = [
        sys.executable, "-m", "gateway.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port), *opts,
    ]  # fmt: skip
    return Proc(args, port, clean_env(env), tmp / f"gateway-{port}.log")


@contextmanager
def running(*procs: Proc, ready_path: str = "/health") -> Iterator[Sequence[Proc]]:
    try:
        for p in procs:
            p.start(ready_path)
        yield procs
    finally:
        for p in procs:
            p.stop()


def scrape(
    url: str, headers: Mapping[str, str] | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a Prometheus endpoint as {(name, sorted labels): value}."""
    text = httpx.get(url, headers=headers, timeout=5).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sim_received(
    engine_url: str, exclude_paths: Sequence[str] = ("/health", "/metrics", "/v1/models")
) -> float:
    """Requests an engine received, from its `sim:received_requests_total`, minus the
    gateway's own health checks and model discovery and the scrape itself."""
    total = 0.0
    for (name, labels), value in scrape(engine_url + "/metrics").items():
        if name == "sim:received_requests_total" and dict(labels).get("path") not in exclude_paths:
            total += value
    return total


class SocketCanary:
    """A bare TCP listener that counts the connections it accepts: a canary at the socket
    level, so even a connection that sends nothing is seen (and it listens on ::1, where
    RecordingServer cannot)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def client_request_id(engine_request_id: str) -> str:
    """The X-Request-Id a client sent, from the id its engine got: the gateway makes a
    client's id unique by appending `-` and 16 hex digits (an id the gateway minted,
    32 hex digits, goes to the engine as it is)."""
    client, sep, suffix = engine_request_id.rpartition("-")
    if sep and len(suffix) == 16:
        return client
    assert len(engine_request_id) == 32, engine_request_id
    return engine_request_id


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def media_gateway_env(
    engine: str, key: str, origin: str, scheme: str, **extra: str
) -> dict[str, str]:
    """A gateway before `engine` that takes `key` and fetches media only from `origin`
    (`host:port` on loopback) over `scheme`."""
    return {
        "GATEWAY_ENGINES": json.dumps([engine]),
        "GATEWAY_API_KEYS": json.dumps([key]),
        "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps([origin]),
        "GATEWAY_MEDIA__ALLOWED_SCHEMES": json.dumps([scheme]),
        "GATEWAY_MEDIA__ALLOWED_NETWORKS": json.dumps(["127.0.0.0/8"]),
        **extra,
    }


def ask_about_image(gateway: str, key: str, image_url: str) -> httpx.Response:
    """A chat request about one image given by URL, as a client sends it."""
    content = [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": "What is this?"},
    ]
    body = {
        "model": "Qwen/Qwen3-VL-2B-Instruct",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": content}],
    }
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(gateway + "/v1/chat/completions", json=body, headers=headers, timeout=30)
