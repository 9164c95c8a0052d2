"""bench/harness/server.py: the ports servers are given, and when a started server counts
as ready."""

from __future__ import annotations

import http.server
import sys
import threading
from pathlib import Path

import pytest

from bench.harness.server import Server, free_port


@pytest.mark.parametrize(("worker", "count"), [("gw0", "2"), ("gw1", "2"), ("gw2", "3")])
def test_each_test_worker_takes_ports_of_its_own_remainder(
    monkeypatch: pytest.MonkeyPatch, worker: str, count: str
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    assert {free_port() // 2 % int(count) for _ in range(20)} == {int(worker[2:])}


def test_outside_xdist_any_port_will_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert len({free_port() // 2 % 2 for _ in range(40)}) == 2


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
    other = http.server.HTTPServer(("127.0.0.1", 0), _Health)
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
