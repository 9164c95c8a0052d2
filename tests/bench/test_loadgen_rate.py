"""bench/suites/loadgen.py: a throughput run's rate is over the elapsed time the load
generator measured, not over the window it was asked for. A target slower than the
window (a loaded machine, a stalled gateway) once read 40 req/s where it served 5."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from bench.suites.fleet import Target
from bench.suites.loadgen import Load, elapsed, run_python

DELAY = 0.4  # seconds the server takes to answer each request
WINDOW = 0.05  # the run's nominal window: every request outlives it


class Slow:
    """A loopback HTTP/1.1 server answering every request after DELAY seconds."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while data := conn.recv(65536):
                buffer += data
                head, sep, rest = buffer.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")),
                    0,
                )  # fmt: skip
                if len(rest) < length:
                    continue
                buffer = rest[length:]
                time.sleep(DELAY)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


@pytest.fixture
def slow() -> Iterator[Slow]:
    server = Slow()
    yield server
    server.sock.close()


def test_elapsed_runs_from_the_first_start_to_the_last_end() -> None:
    assert elapsed([(100.0, 100.6), (100.1, 100.5)]) == pytest.approx(0.6)
    assert elapsed([(5.0, 7.5)]) == pytest.approx(2.5)
    assert elapsed([]) == 0.0


@pytest.mark.slow
def test_the_rate_is_over_the_elapsed_time_not_the_window(slow: Slow) -> None:
    target = Target("slow", f"http://127.0.0.1:{slow.port}")
    result = run_python(target, Load("/", b"{}", 2, WINDOW))
    # Each connection sent one request in the window and waited DELAY for its answer.
    assert result.requests == 2 and result.errors == 0
    assert result.duration_s >= DELAY
    assert result.rps == pytest.approx(result.requests / result.duration_s)
    assert result.rps <= result.requests / DELAY
    assert result.as_dict()["duration_s"] == round(result.duration_s, 3)
