"""What a suite run starts and drives: the CPUs it pins to, the servers it starts on
loopback (simulated engines, the gateway, the image floor, peer proxies), the targets
the load generators talk to (a base URL plus the headers it needs), and the run's
configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.redis_server import RedisServer
from bench.harness.server import Server, clean_env, free_port

BENCH_KEY = "bench-local-key-not-secret"


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

    def at_once(self, *starts: Callable[[], Server]) -> list[Server]:
        """Run `starts` (e.g. `partial(fleet.sim, ...)`) side by side: each waits for its
        server to answer, so the servers are up in the time of the slowest, not the sum.
        A server that started is stopped with the fleet even if another start failed."""
        with ThreadPoolExecutor(len(starts)) as pool:
            futures = [pool.submit(start) for start in starts]
            return [f.result() for f in futures]

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

    def redis(self) -> RedisServer:
        """A fresh, empty redis-server on a free loopback port, stopped with the fleet."""
        port = free_port()
        server = RedisServer(port, self.workdir / f"redis-{port}.log").start()
        self._stack.callback(server.stop)
        return server

    def floor(
        self, engine: str, allocator: str = "gateway", name: str = "floor", decode: bool = False
    ) -> Server:
        """bench/suites/floor.py in front of `engine`, pinned as the gateway is; `decode`: with
        Pillow's decode of each data: image."""
        port = free_port()
        args = [sys.executable, "-m", "bench.suites.floor", "--port", str(port), "--engine", engine]
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
        binary = peer_binary("vllm-router")
        if binary is None:
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

    def sglang_router(
        self,
        engines: Sequence[str],
        policy: str = "round_robin",
        name: str = "sglang-router",
        wrap: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> Server | None:
        """sglang-router (PyPI) in front of the engines, or None when it is not installed."""
        binary = peer_binary("sglang-router")
        if binary is None:
            return None
        port = free_port()
        args = sglang_router_args(binary, port, engines, policy, free_port())
        log = self.workdir / f"{name}-{port}.log"
        server = Server(name, [*wrap, *args], port, log, cpus=self.cpus.proxy)
        # Ready once every worker passed its health check (its /health answers before).
        server.ready_path = "/readiness"
        return self._start(server, timeout=timeout)

    def litellm(
        self,
        engine: str,
        model: str,
        binary: Path | None,
        name: str = "litellm",
        timeout: float = 180.0,
    ) -> Server | None:
        """The LiteLLM proxy (its `litellm` command from `binary`, see `litellm_binary`)
        in front of `engine` as an OpenAI-compatible backend serving `model`, or None when
        it is not installed. Clients send `Authorization: Bearer LITELLM_KEY`."""
        if binary is None:
            return None
        port = free_port()
        folder = self.workdir / f"{name}-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "config.yaml"
        conf.write_text(litellm_config(engine, model, LITELLM_KEY))
        args = [str(binary), "--config", str(conf), "--host", "127.0.0.1", "--port", str(port)]
        args += ["--num_workers", "1"]
        env = clean_env(
            {
                # No download of the model price list and no telemetry: loopback only.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_TELEMETRY": "False",
                "LITELLM_LOG": "ERROR",
            }
        )
        server = Server(name, args, port, folder / "stdout.log", env=env, cpus=self.cpus.proxy)
        server.ready_path = "/health/liveliness"
        return self._start(server, timeout=timeout)


def peer_binary(name: str) -> Path | None:
    """A peer's command installed beside this Python (`pip install vllm-router
    sglang-router`), or None."""
    binary = Path(sys.executable).parent / name
    return binary if binary.exists() else None


def sglang_router_args(
    binary: Path, port: int, engines: Sequence[str], policy: str, metrics_port: int
) -> list[str]:
    """sglang-router's command line (`sglang-router launch`, 0.3): one router on loopback,
    its metrics listener on `metrics_port` (the default, 29000 on every interface, makes
    a second router on the machine exit at start)."""
    args = [str(binary), "launch", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--policy", policy, "--worker-urls", *engines, "--log-level", "warn"]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return args


# The LiteLLM proxy refuses to start without a master key (every client must send it).
LITELLM_KEY = "sk-bench-local-key-not-secret-0123456789abcdef"
# Where the bench looks for LiteLLM when neither --litellm nor $BENCH_LITELLM says: a
# venv of its own, so its many dependencies never touch the project's.
LITELLM_VENV = Path.home() / ".cache" / "vllm-gateway" / "litellm-venv"


def litellm_binary(explicit: Path | None = None) -> Path | None:
    """The `litellm` command: `explicit`, else $BENCH_LITELLM, else LITELLM_VENV's; None
    when that file does not exist."""
    env = os.environ.get("BENCH_LITELLM")
    path = explicit or (Path(env) if env else LITELLM_VENV / "bin" / "litellm")
    return path if path.exists() else None


def litellm_config(engine: str, model: str, master_key: str) -> str:
    """LiteLLM's proxy configuration: `model` served by `engine` as an OpenAI-compatible
    backend, clients authenticated by `master_key`. JSON, which is YAML too."""
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    # The `openai/` prefix: any OpenAI-compatible server at api_base.
                    "model": f"openai/{model}",
                    "api_base": engine.rstrip("/") + "/v1",
                    # The simulated engine takes no key; LiteLLM needs one to send.
                    "api_key": "bench-engine-takes-no-key",
                },
            }
        ],
        "litellm_settings": {"telemetry": False},
        "general_settings": {"master_key": master_key},
    }
    return json.dumps(config, indent=1)


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
    # overhead: the LiteLLM proxy's `litellm` command (None: not installed, skipped).
    litellm: Path | None = None

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
