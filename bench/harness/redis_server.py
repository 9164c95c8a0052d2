"""A throwaway redis-server on loopback, for the routing bench's shared store and the
store's tests: no persistence, its own port, stopped by PID."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from bench.harness.server import ROOT, terminate


def redis_server_path() -> str | None:
    """The redis-server binary, or None when it is not installed."""
    return shutil.which("redis-server")


def ping(port: int, timeout: float = 0.5, password_required: bool = False) -> bool:
    """True when a Redis server answers PING on loopback `port` (with a password set,
    it answers that one is needed: that is an answer too)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            answer = s.recv(64)
            return answer.startswith(b"+PONG") or (password_required and b"NOAUTH" in answer)
    except OSError:
        return False


class RedisServer:
    """`redis-server` on 127.0.0.1:`port`, in memory only. `start` waits for PING;
    `stop` ends it by its PID (it can be started again on the same port: the data is
    gone, as after a restart without persistence)."""

    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self, timeout: float = 20.0, extra: Sequence[str] = ()) -> Self:
        """Start it (`extra`: more redis-server options) and wait until it answers."""
        binary = redis_server_path()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "yes", *extra]
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited early:\n{self.log_path.read_text()}")
            if ping(self.port, password_required="--requirepass" in extra):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING in {timeout}s")

    def stop(self) -> None:
        terminate(self.popen)
        self.popen = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
