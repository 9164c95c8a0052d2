"""Servers on loopback as subprocesses: the toolkit the tests and the suites start
processes with (tests/procs.py is a thin layer over it).

Each server writes its output to a log file, is optionally pinned to a set of CPUs
(children such as uvicorn workers inherit the mask) and is ready once a path answers;
`terminate` ends it with its whole process tree when it does not leave in time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from bench.harness.process_tree import listening_inodes, process_tree, socket_inodes

# The repository: the servers' working directory, so `python -m bench.sim` and
# `python -m gateway.cli` import this checkout.
ROOT = Path(__file__).resolve().parents[2]


# Ports handed out in the last HOLD_SECONDS, kept in one file that every process of this
# user reads and writes under an exclusive lock. It covers the time between a pick and the
# child's bind (the longest start the suites allow is 300 s, a real engine's).
HOLD_SECONDS = 300.0
LEDGER_ENV = "VLLM_GATEWAY_PORT_LEDGER"


def _ledger() -> Path:
    """The ledger file: $VLLM_GATEWAY_PORT_LEDGER, or the user's cache folder (not the temp
    folder: tests give their children a TMPDIR of their own)."""
    named = os.environ.get(LEDGER_ENV)
    if named:
        return Path(named)
    folder = Path.home() / ".cache" / "vllm-gateway"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "ports"


def free_port() -> int:
    """A TCP port free on loopback now that no caller of this function, in any process of
    this user, was given in the last HOLD_SECONDS. The kernel's pick alone repeats (it
    starts at a random offset on each bind), and two servers given one port before either
    binds it leave one of them unable to start, or answering for the other."""
    path = _ledger()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)  # released when the file is closed
        now = time.time()
        held: dict[int, float] = {}
        for line in ledger.read().splitlines():
            given, _, at = line.partition(" ")
            with contextlib.suppress(ValueError):
                if now - float(at) < HOLD_SECONDS:
                    held[int(given)] = float(at)
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in held:
                break
        else:
            raise RuntimeError("no free port on 127.0.0.1")
        held[port] = now
        ledger.seek(0)
        ledger.truncate()
        ledger.write("".join(f"{p} {at}\n" for p, at in held.items()))
    return port


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


def http_status(
    url: str, timeout: float = 0.5, context: ssl.SSLContext | None = None
) -> int | None:
    """Status of a GET (an https:// one trusting `context`), or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:  # noqa: S310 (loopback)
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
    # A server on TLS: the client context that trusts its certificate; `url` is https://.
    tls: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

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
            status = http_status(url, context=self.tls)
            # Ready once it answers on a socket of its own: a port another process took
            # first answers too, until this one fails to bind and exits.
            if status is not None and status < 500 and self._listens():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready in {timeout}s:\n{self.log_tail()}")

    def _listens(self) -> bool:
        """Whether the process or one of its descendants listens on `port`."""
        assert self.popen is not None
        mine = socket_inodes(process_tree(self.popen.pid))
        return bool(listening_inodes(self.port) & mine)

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
