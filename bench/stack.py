"""Servers a benchmark run starts on loopback: simulated engines, the gateway, peer proxies.

Each server is a subprocess with its output in a log file under the run's work directory,
optionally pinned to a set of CPUs (children such as uvicorn workers inherit the mask).
`Target` is what the load generators talk to: a base URL plus the headers it needs.

This is also the one toolkit the tests start processes with (tests/procs.py is a thin
layer over it): `free_port`, `clean_env`, `Server`, `terminate` and `scrape`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
BENCH_KEY = "bench-local-key-not-secret"


def free_port() -> int:
    """A TCP port free on loopback now (the kernel's pick; another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class InThread:
    """Work done by a daemon thread while a `with` block runs: `run` in the thread,
    `stop` (from the caller's thread) to make it return; the block's end waits for it."""

    def __init__(self) -> None:
        self._thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._thread.join()


@dataclass(frozen=True)
class CpuPlan:
    """Which CPUs the proxy under test and everything else (engines, load generator) use.

    On a 2-core machine the proxy gets core 0 to itself and the engine and the load
    generator share core 1, so the proxy's CPU time is not diluted by its neighbours
    (every peer in docs/facts.md was measured this way). With one CPU nothing is pinned.
    """

    proxy: frozenset[int] | None
    rest: frozenset[int] | None

    @classmethod
    def detect(cls) -> CpuPlan:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return cls(None, None)
        return cls(frozenset(cpus[:1]), frozenset(cpus[1:]))

    def describe(self) -> str:
        if self.proxy is None:
            return "not pinned (one CPU)"
        return (
            f"proxy under test on CPU {sorted(self.proxy)}; engines and load generator "
            f"on CPU {sorted(self.rest or [])}"
        )

    def pin_self(self) -> None:
        if self.rest is not None:
            os.sched_setaffinity(0, self.rest)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without GATEWAY_ settings or proxy variables, for a server child."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GATEWAY_") and k.lower() not in ("http_proxy", "https_proxy")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def http_status(url: str, timeout: float = 0.5) -> int | None:
    """Status of a GET, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback)
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


class LoopbackChild:
    """A child process serving on a loopback `port`, writing its output to `log_path`."""

    port: int
    popen: subprocess.Popen[bytes] | None
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def log(self) -> str:
        """Everything the process wrote so far ("" when there is no log yet)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]


@dataclass
class Server(LoopbackChild):
    """A server subprocess on loopback. The caller must `stop()` it (or use a `Fleet`)."""

    name: str
    args: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=clean_env)
    cpus: frozenset[int] | None = None
    ready_path: str = "/health"
    popen: subprocess.Popen[bytes] | None = None

    def start(self, ready_path: str | None = None, timeout: float = 30.0) -> Self:
        """Start the process and wait until `ready_path` (default `self.ready_path`)
        answers below 500; stop it and raise if it exits or is not ready in time."""
        cpus = self.cpus

        def pin() -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        with self.log_path.open("wb") as log:
            # The child keeps its own copy of the descriptor; closing ours avoids a
            # ResourceWarning, which pytest turns into an error.
            self.popen = subprocess.Popen(
                self.args,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Only when pinning: preexec_fn is unsafe in a threaded parent (the
                # tests start servers from a thread pool).
                preexec_fn=pin if cpus is not None else None,
            )
        url = self.url + (ready_path or self.ready_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            status = http_status(url)
            if status is not None and status < 500:
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready in {timeout}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """Stop at once, like a crashed engine."""
        if self.alive():
            assert self.popen is not None
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        terminate(self.popen)


def terminate(popen: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    """SIGTERM a child that is still running; if it has not left in `grace` seconds,
    SIGKILL it and every process under it (a supervisor killed alone would leave its
    uvicorn workers running, orphaned)."""
    if popen is None or popen.poll() is not None:
        return
    popen.terminate()
    try:
        popen.wait(grace)
    except subprocess.TimeoutExpired:
        for pid in reversed(process_tree(popen.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        popen.wait(30)


# --- process accounting (/proc) ---------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name sits in parentheses and may hold spaces: split after it.
    return raw[raw.rindex(")") + 2 :].split()


def _children(pid: int) -> list[int] | None:
    """`pid`'s children from its threads' `children` files (proc(5)), which read nothing
    of other processes; None where the kernel has no such files."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return None
    found: list[int] = []
    for tid in tids:
        try:
            found += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _children_by_scan() -> dict[int, list[int]]:
    """Every process's children, from each /proc/<pid>/stat's parent field."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (uvicorn workers, nginx workers). Read from the
    processes' own `children` files, not by scanning every process on the machine: the
    soak samples it every second, and a scan reads hundreds of other processes' entries
    while test suites run beside it."""
    scanned: dict[int, list[int]] | None = None
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        kids = _children(p)
        if kids is None:
            scanned = scanned if scanned is not None else _children_by_scan()
            kids = scanned.get(p, [])
        todo.extend(kids)
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` and its live descendants (utime, stime of /proc/stat)."""
    total = 0
    for p in process_tree(pid):
        fields = _stat_fields(p)
        if fields is not None:
            # Fields 14 and 15 of proc(5), counted from 1; index 11 and 12 after the name.
            total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants (VmRSS)."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


# --- metrics ----------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# One client for short calls on loopback: `httpx.get()` builds a client, and with it a
# TLS context, on every call (13 ms here, more on a busy machine), which scrapes taken
# every second kept paying. No keep-alive: the servers come and go between calls.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def scrape(url: str, headers: Mapping[str, str] | None = None, timeout: float = 5.0) -> Samples:
    """Samples of a Prometheus endpoint (the full URL, `.../metrics`) as
    {(name, sorted labels): value}."""
    text = HTTP.get(url, headers=headers, timeout=timeout).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        value
        for (n, ls), value in samples.items()
        if n == name and labels.items() <= dict(ls).items()
    )


# --- targets and fleets --------------------------------------------------------------


@dataclass
class Target:
    """An endpoint the load generators send to: direct to an engine, or through a proxy."""

    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    # The local process whose CPU time is charged to this target (None: not measured).
    pid: int | None = None

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        hostport = self.url.split("://", 1)[1].split("/", 1)[0]
        return int(hostport.rsplit(":", 1)[1]) if ":" in hostport else 80


class Fleet:
    """Servers started for one run; `close()` stops them all in reverse order."""

    def __init__(self, workdir: Path, cpus: CpuPlan) -> None:
        self.workdir = workdir
        self.cpus = cpus
        self._stack = ExitStack()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def _start(self, server: Server, timeout: float = 30.0) -> Server:
        server.start(timeout=timeout)
        self._stack.callback(server.stop)
        return server

    def sim(self, *opts: str, name: str = "sim") -> Server:
        port = free_port()
        args = [sys.executable, "-m", "bench.sim", "--host", "127.0.0.1", "--port", str(port)]
        log = self.workdir / f"{name}-{port}.log"
        return self._start(Server(name, [*args, *opts], port, log, cpus=self.cpus.rest))

    def gateway(
        self,
        engines: Sequence[str],
        env: Mapping[str, str] | None = None,
        workers: int = 1,
        name: str = "gateway",
        pin: bool = True,
        tree: Path | None = None,
        wrap: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> Server:
        """The gateway in front of `engines`; with `tree`, the gateway package of that
        checkout instead of this one's; `wrap` runs it under a tool (e.g. valgrind)."""
        port = free_port()
        args = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1"]
        if tree is not None:
            run = "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
            run += "runpy.run_module('gateway.cli', run_name='__main__', alter_sys=True)"
            args = [sys.executable, "-c", run, str(tree.resolve()), "serve", "--host", "127.0.0.1"]
        args += ["--port", str(port)]
        if workers > 1:
            args += ["--workers", str(workers)]
        settings = {
            "GATEWAY_ENGINES": json.dumps(list(engines)),
            "GATEWAY_API_KEYS": json.dumps([BENCH_KEY]),
            # One key is the whole load here: its share is the gateway's whole cap (the
            # default, a quarter, would answer 429 at the scale bench's 1,024 connections).
            "GATEWAY_LIMITS__MAX_IN_FLIGHT_PER_KEY": "1024",
            **(env or {}),
        }
        log = self.workdir / f"{name}-{port}.log"
        cpus = self.cpus.proxy if pin else None
        server = Server(name, [*wrap, *args], port, log, env=clean_env(settings), cpus=cpus)
        # /readyz, not /healthz: ready means an engine is healthy and its models are
        # known (a request sent before that was refused, the model unknown, in a bench run).
        server.ready_path = "/readyz"
        return self._start(server, timeout=timeout)

    def floor(
        self, engine: str, allocator: str = "gateway", name: str = "floor", decode: bool = False
    ) -> Server:
        """bench/floor.py in front of `engine`, pinned as the gateway is; `decode`: with
        Pillow's decode of each data: image."""
        port = free_port()
        args = [sys.executable, "-m", "bench.floor", "--port", str(port), "--engine", engine]
        args += ["--allocator", allocator, *(["--decode"] if decode else [])]
        log = self.workdir / f"{name}-{port}.log"
        server = Server(name, args, port, log, cpus=self.cpus.proxy)
        server.ready_path = "/health"
        return self._start(server)

    def nginx(self, engine: str, name: str = "nginx") -> Server | None:
        """nginx as a plain keep-alive reverse proxy, or None when it is not installed."""
        binary = shutil.which("nginx") or (
            "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
        )
        if binary is None:
            return None
        port = free_port()
        prefix = self.workdir / f"{name}-{port}"
        (prefix / "logs").mkdir(parents=True, exist_ok=True)
        upstream = engine.split("://", 1)[1].rstrip("/")
        conf = prefix / "nginx.conf"
        conf.write_text(NGINX_CONF.format(port=port, upstream=upstream, prefix=prefix))
        args = [binary, "-p", str(prefix), "-c", str(conf)]
        server = Server(name, args, port, prefix / "stdout.log", cpus=self.cpus.proxy)
        server.ready_path = "/health"
        return self._start(server)

    def vllm_router(
        self,
        engines: Sequence[str],
        policy: str = "round_robin",
        name: str = "vllm-router",
        wrap: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> Server | None:
        """vllm-router (PyPI) in front of the engines, or None when it is not installed."""
        binary = Path(sys.executable).parent / "vllm-router"
        if not binary.exists():
            return None
        port = free_port()
        args = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
        args += ["--worker-urls", *engines, "--log-level", "warning"]
        # Its metrics listener defaults to port 29000: a second router on the machine
        # (another run) would make this one exit at start.
        args += ["--prometheus-port", str(free_port())]
        log = self.workdir / f"{name}-{port}.log"
        server = Server(name, [*wrap, *args], port, log, cpus=self.cpus.proxy)
        server.ready_path = "/health"
        return self._start(server, timeout=timeout)


# One worker on one core, upstream keep-alive (without it every request opens a new
# connection to the engine and nginx measures connection setup, not proxying).
NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    client_max_body_size 64m;
    upstream engine {{ server {upstream}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            tcp_nodelay on;
        }}
    }}
}}
"""


def iter_pids(targets: Sequence[Target]) -> Iterator[int]:
    for t in targets:
        if t.pid is not None:
            yield t.pid


@dataclass
class RunConfig:
    """How a suite runs: on local simulated engines, or against a real deployment."""

    workdir: Path
    cpus: CpuPlan
    # Real deployment: engine base URLs and the gateway in front of them (no local servers).
    engine_urls: list[str] = field(default_factory=list)
    gateway_url: str | None = None
    api_key: str = BENCH_KEY
    engine_api_key: str | None = None
    model: str | None = None
    quick: bool = False
    peers: bool = True
    loadgen: str = "auto"
    # soak: seconds of traffic (None: the suite's default).
    duration: float | None = None
    # overhead: the image cases alone.
    images_only: bool = False
    # overhead: another checkout whose gateway runs beside this one's.
    baseline_tree: Path | None = None

    @property
    def external(self) -> bool:
        return bool(self.engine_urls)

    def direct_target(self, url: str, pid: int | None = None) -> Target:
        headers = {}
        if self.engine_api_key:
            headers["Authorization"] = f"Bearer {self.engine_api_key}"
        return Target("direct", url.rstrip("/"), headers, pid)

    def gateway_target(self, url: str, pid: int | None = None, name: str = "gateway") -> Target:
        return Target(name, url.rstrip("/"), {"Authorization": f"Bearer {self.api_key}"}, pid)


def discover_model(target: Target) -> str:
    """The first model the engine lists on /v1/models."""
    req = urllib.request.Request(target.url + "/v1/models", headers=target.headers)  # noqa: S310
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (configured URL)
        return str(json.loads(resp.read())["data"][0]["id"])
