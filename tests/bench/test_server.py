"""bench/harness/server.py: the ports servers are given, and when a started server counts
as ready."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.harness.server import HOLD_SECONDS, LEDGER_ENV, ROOT, Server, free_port

PICKER = """
import sys
from bench.harness.server import free_port
print(" ".join(str(free_port()) for _ in range(int(sys.argv[1]))))
"""


def test_two_processes_picking_at_once_are_never_given_one_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's pick alone repeats: 400 picks among Linux's 14,116 odd ports repeat
    one about 5.7 times on average. A CI run once failed because a gateway's port had
    been given to another server of the same test worker first."""
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ports"))
    cmd = [sys.executable, "-c", PICKER, "200"]
    pickers = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE) for _ in range(2)]
    ports = [int(p) for proc in pickers for p in proc.communicate(timeout=60)[0].split()]
    assert [proc.returncode for proc in pickers] == [0, 0]
    assert len(ports) == 400
    assert len(set(ports)) == 400


def test_a_port_is_held_for_its_hold_and_forgotten_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = tmp_path / "ports"
    monkeypatch.setenv(LEDGER_ENV, str(ledger))
    long_ago = time.time() - HOLD_SECONDS - 1
    ledger.write_text("".join(f"{port} {long_ago}\n" for port in range(32768, 61000)))
    port = free_port()  # every port's hold has ended: any will do
    assert held(ledger) == [port]
    again = free_port()
    assert again != port
    assert held(ledger) == [port, again]


def held(ledger: Path) -> list[int]:
    return [int(line.split()[0]) for line in ledger.read_text().splitlines()]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_whose_port_another_process_answers_on_is_not_ready(tmp_path: Path) -> None:
    """A port taken between its pick and the child's bind: the other listener answers the
    readiness check, but the child never listens and exits. Before, the start returned
    as if the child were up, and the caller talked to the other server."""
    other = http.server.HTTPServer(("127.0.0.1", free_port()), _Health)
    port = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        args = [sys.executable, "-m", "bench.sim", "--host", "127.0.0.1", "--port", str(port)]
        server = Server("sim", args, int(port), tmp_path / "sim.log")
        with pytest.raises(RuntimeError, match="exited early"):
            server.start(timeout=30)
        assert "address already in use" in server.log().lower()
    finally:
        other.shutdown()
        other.server_close()
