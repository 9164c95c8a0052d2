"""`start_all` on real processes that come up slowly, like vLLM engines: however the
start ends, no engine is left running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest

from bench.harness.process_tree import process_tree
from bench.harness.realvllm.home import Home
from bench.harness.realvllm.launcher import Engine, start_all

# Answers GET /health once the file `gate` exists, then touches `up`. Its child process
# is stopped with it, as an engine's API server stops its engine core on SIGTERM.
SERVER = """
import http.server, os, pathlib, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def stop(signum, frame):
    child.terminate(); child.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
pathlib.Path(sys.argv[3]).touch()
server.serve_forever()
"""
# Exits once the file `up` exists.
FAILING = (
    "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\nsys.exit(1)"
)


class SlowServer(Engine):
    gate: Path = Path("/nonexistent")
    up: Path = Path("/nonexistent")

    def command(self) -> list[str]:
        return [sys.executable, "-c", SERVER, str(self.port), str(self.gate), str(self.up)]


class Failing(SlowServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", FAILING, str(self.up)]


class Interrupted(Exception):
    pass


def _home(tmp_path: Path) -> Home:
    home = Home(tmp_path / "home")
    home.python.parent.mkdir(parents=True)
    home.python.touch()
    home.model("m").mkdir(parents=True)
    return home


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_an_interrupted_start_stops_every_engine(tmp_path: Path) -> None:
    """Ctrl-C, or a test's time-out, while engines start: before the fix, the engines came
    up after the interruption and ran on."""
    home = _home(tmp_path)
    engines = [SlowServer("m", home=home, workdir=tmp_path / f"e{i}") for i in range(2)]
    for e in engines:
        e.gate = tmp_path / "gate"
        e.up = tmp_path / f"up-{e.port}"
    trees: list[int] = []

    def interrupt() -> None:
        # Once both servers and their children run, as SIGINT reaches a foreground job;
        # then the servers may come up.
        while len(trees) < 4:
            trees[:] = [p for e in engines if e.popen for p in process_tree(e.popen.pid)]
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
        (tmp_path / "gate").touch()

    def raise_interrupted(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGINT, raise_interrupted)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(Interrupted):
            start_all(engines, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(trees) == 4
    assert _gone(trees), [p for p in trees if _alive(p)]


def test_a_failed_start_stops_the_engines_that_came_up(tmp_path: Path) -> None:
    home = _home(tmp_path)
    fast = SlowServer("m", home=home, workdir=tmp_path / "fast")
    fast.gate = tmp_path
    fast.up = tmp_path / "up"
    # Fails once `fast` serves.
    failing = Failing("m", home=home, workdir=tmp_path / "failing")
    failing.up = fast.up
    with pytest.raises(RuntimeError, match="exited early"):
        start_all([fast, failing], timeout=60)
    assert fast.up.exists()
    assert fast.popen is not None and failing.popen is not None
    assert fast.popen.poll() is not None and failing.popen.poll() is not None


def test_engines_that_come_up_are_returned_running(tmp_path: Path) -> None:
    home = _home(tmp_path)
    engines = [SlowServer("m", home=home, workdir=tmp_path / f"e{i}") for i in range(2)]
    for e in engines:
        e.gate = tmp_path
        e.up = tmp_path / f"up-{e.port}"
    try:
        assert start_all(engines, timeout=60) == engines
        assert all(e.popen is not None and e.popen.poll() is None for e in engines)
    finally:
        for e in engines:
            e.stop()
