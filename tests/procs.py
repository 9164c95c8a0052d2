"""Real servers on loopback for tests: subprocesses (engines, the gateway) and in-process
threaded servers (canaries and media origins) that record every connection they get.

A thin layer over the bench's toolkit (bench/harness/server.py, bench/harness/origin.py): the same
`Server`, ports, environment and scraper, with the defaults the tests want.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.metrics import HTTP, Samples, scrape, total
from bench.harness.origin import Hit, RecordingServer, Route
from bench.harness.samples import wav
from bench.harness.server import ROOT, Server, clean_env, free_port
from bench.sim.config import DEFAULT_MODEL

OriginT = TypeVar("OriginT")
T = TypeVar("T")

__all__ = ["ROOT", "Hit", "RecordingServer", "Route", "free_port", "scrape", "total"]


class Proc(Server):
    """A server subprocess for a test (bench.harness.server.Server): ready within 45 s.
    A bound a loaded machine keeps: each of `serve --workers 2`'s workers imports the
    whole gateway again, which took 18 s beside three test runs (load 11)."""

    def start(self, ready_path: str | None = None, timeout: float = 45.0) -> Self:
        return super().start(ready_path, timeout)


@dataclass
class MediaStack(Generic[OriginT]):
    """A simulated engine, a gateway in front of it, and the media origin it fetches from."""

    sim: Proc
    gateway: Proc
    origin: OriginT


def sim_proc(tmp: Path, *opts: str, port: int | None = None) -> Proc:
    """A simulated engine (`python -m bench.sim`), not yet started."""
    port = port or free_port()
    args = [sys.executable, "-m", "bench.sim", "--host", "127.0.0.1", "--port", str(port), *opts]
    return Proc("sim", args, port, tmp / f"sim-{port}.log")


def gateway_proc(
    tmp: Path,
    env: Mapping[str, str],
    *opts: str,
    port: int | None = None,
    tls: ssl.SSLContext | None = None,
) -> Proc:
    """The gateway under uvicorn (`vllm-gateway serve`), not yet started. `tls`: it
    serves TLS (its options in `opts` or `env`), and this client context trusts it."""
    port = port or free_port()
    args = [
        sys.executable, "-m", "gateway.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port), *opts,
    ]  # fmt: skip
    log = tmp / f"gateway-{port}.log"
    return Proc("gateway", args, port, log, env=clean_env(env), tls=tls)


def run_cli(
    *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m gateway.cli ARGS` as an operator runs it (the console script's module),
    its output captured as text; the caller checks the return code."""
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        input=stdin,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@contextmanager
def running(*procs: Proc, ready_path: str = "/health") -> Iterator[Sequence[Proc]]:
    """`procs` started side by side, each waited for until `ready_path` answers: up in
    the time of the slowest, not the sum. They must not need each other to start (a
    gateway that should find its engines up is started in a `running` block of its own,
    nested in theirs). On leaving, every one is stopped, even when stopping another
    raised; when one fails to start, the others are stopped and its error raised."""
    with ExitStack() as stack:
        for p in procs:
            stack.callback(p.stop)
        if len(procs) == 1:
            procs[0].start(ready_path)
        else:
            with ThreadPoolExecutor(len(procs)) as pool:
                futures = [pool.submit(p.start, ready_path) for p in procs]
            for future in futures:
                future.result()
        yield procs


@contextmanager
def recording_engines(tmp: Path, count: int, record: int) -> Iterator[list[Proc]]:
    """`count` simulated engines that answer at once and keep their last `record`
    requests in /sim/requests (where a test reads which engine got a request);
    stopped on leaving."""
    opts = ("--latency", "zero", "--record-requests", str(record))
    sims = [sim_proc(tmp, *opts) for _ in range(count)]
    with running(*sims):
        yield sims


def every_worker_lists(gateway: Proc, workers: int, model: str, headers: Mapping[str, str]) -> bool:
    """Whether each of the gateway's `workers` processes has started (its
    `gateway_started` log line: the kernel hands new connections only to workers already
    accepting, so answers alone may all come from the first one up) and `model` is in
    /v1/models on six fresh connections in a row (each worker has its own pool)."""
    if gateway.log().count('"event":"gateway_started"') < workers:
        return False
    for _ in range(6):
        r = HTTP.get(gateway.url + "/v1/models", headers=headers, timeout=5)
        if r.status_code != 200 or model not in r.text:
            return False
    return True


def by_worker(
    url: str, admin_key: str, call: Callable[[httpx.Client], T], times: int
) -> list[tuple[int, T]]:
    """`call` made `times` times, each on a new connection that first asks
    /gateway/status (with `admin_key`) which worker process holds it: (that worker's pid,
    what `call` returned), in order. A worker keeps a connection: `call`'s requests on the
    client go to the worker named."""
    out: list[tuple[int, T]] = []
    for _ in range(times):
        with httpx.Client(base_url=url, timeout=10) as client:
            r = client.get("/gateway/status", headers=auth(admin_key))
            assert r.status_code == 200, r.text
            out.append((int(r.json()["process"]["pid"]), call(client)))
    return out


def counted_by_worker(
    url: str, admin_key: str, times: int, headers: Mapping[str, str] | None = None
) -> list[tuple[int, Samples]]:
    """`times` scrapes of /metrics (with `headers`), each on a new connection, with the
    pid of the worker that answered it (by_worker)."""

    def scrape_on(client: httpx.Client) -> Samples:
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 200, r.text
        out: Samples = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    return by_worker(url, admin_key, scrape_on, times)


def worker_pids(gateway: Proc) -> set[int]:
    """The pids of the worker processes of `gateway` (`serve --workers N`): its running
    children that multiprocessing spawned, its resource tracker aside (Linux: /proc)."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == gateway.pid and state != "Z" and b"spawn_main" in cmdline:
            found.add(int(entry.name))
    return found


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples with these labels on the server at `url` (its /metrics)."""
    return total(scrape(url + "/metrics"), name, **labels)


def sim_received(
    engine_url: str, exclude_paths: Sequence[str] = ("/health", "/metrics", "/v1/models")
) -> float:
    """Requests an engine received, from its `sim:received_requests_total`, minus the
    gateway's own health checks and model discovery and the scrape itself."""
    received = 0.0
    for (name, labels), value in scrape(engine_url + "/metrics").items():
        if name == "sim:received_requests_total" and dict(labels).get("path") not in exclude_paths:
            received += value
    return received


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


def owned_response_id(key: str, namespace_secret: str, part: str = "0" * 32) -> str:
    """A stored response id that `key` owns behind a gateway configured with
    `namespace_secret`, in the form the gateway gives `POST /v1/responses`: `gw-`, 32 hex
    digits, and their tag (HMAC-SHA256 under the secret, over the key's digest and the
    digits), cut to 32 hex digits. Written out here, so a change of form shows."""
    owner = hashlib.sha256(key.encode()).hexdigest()
    material = f"response:{len(owner)}:{owner}:{part}".encode()
    tag = hmac.new(namespace_secret.encode(), material, hashlib.sha256).hexdigest()[:32]
    return f"gw-{part}{tag}"


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


def auth(key: str) -> dict[str, str]:
    """The header that presents `key` to the gateway."""
    return {"Authorization": f"Bearer {key}"}


def error_code(resp: httpx.Response) -> str | None:
    """The stable `code` of a gateway's error answer; None when `resp` is not one."""
    try:
        return str(resp.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


@asynccontextmanager
async def held_streams(
    client: httpx.AsyncClient, count: int, key: str, body: Mapping[str, Any]
) -> AsyncIterator[None]:
    """`count` streamed chat completions of `key`, each answered 200 and held open (a
    slot taken) until the block ends."""
    async with AsyncExitStack() as streams:
        for _ in range(count):
            request = client.stream("POST", "/v1/chat/completions", headers=auth(key), json=body)
            resp = await streams.enter_async_context(request)
            assert resp.status_code == 200
        yield


def leave_after(
    gateway: str, path: str, key: str, body: Mapping[str, Any], outputs: int, timeout: float = 30
) -> list[dict[str, Any]]:
    """The events of a `path` stream up to its `outputs`-th output event (an Anthropic
    `content_block_delta`, a Responses `response.output_text.delta`); then the client
    leaves."""
    events: list[dict[str, Any]] = []
    seen = 0
    with HTTP.stream("POST", gateway + path, headers=auth(key), json=body, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                seen += events[-1]["type"] in ("content_block_delta", "response.output_text.delta")
            if seen == outputs:
                break
    return events


def transcribe(gateway: str, key: str, data: Mapping[str, str]) -> httpx.Response:
    """An upload to /v1/audio/transcriptions: a short WAV file and the form fields `data`."""
    return HTTP.post(
        gateway + "/v1/audio/transcriptions",
        headers=auth(key),
        files={"file": ("a.wav", wav(), "audio/wav")},
        data=data,
        timeout=30,
    )


def ask_about_image(gateway: str, key: str, image_url: str) -> httpx.Response:
    """A chat request about one image given by URL, as a client sends it."""
    content = [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": "What is this?"},
    ]
    body = {
        "model": DEFAULT_MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": content}],
    }
    headers = {"Authorization": f"Bearer {key}"}
    return HTTP.post(gateway + "/v1/chat/completions", json=body, headers=headers, timeout=30)
