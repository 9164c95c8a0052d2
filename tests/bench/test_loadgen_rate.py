"""bench/suites/loadgen.py: a throughput run's rate is over the elapsed time the load
generator measured, not over the window it was asked for. A target slower than the
window (a loaded machine, a stalled gateway) once read 40 req/s where it served 5."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.harness.origin import RecordingServer, Route
from bench.suites.fleet import Target
from bench.suites.loadgen import Load, elapsed, run_python

DELAY = 0.4  # seconds the server takes to answer each request
WINDOW = 0.05  # the run's nominal window: every request outlives it


@pytest.fixture
def slow() -> Iterator[RecordingServer]:
    """A loopback HTTP/1.1 server answering every request after DELAY seconds."""
    with RecordingServer({"/": Route(body=b"ok", delay=DELAY)}) as server:
        yield server


def test_elapsed_runs_from_the_first_start_to_the_last_end() -> None:
    assert elapsed([(100.0, 100.6), (100.1, 100.5)]) == pytest.approx(0.6)
    assert elapsed([(5.0, 7.5)]) == pytest.approx(2.5)
    assert elapsed([]) == 0.0


@pytest.mark.slow
def test_the_rate_is_over_the_elapsed_time_not_the_window(slow: RecordingServer) -> None:
    target = Target("slow", f"http://127.0.0.1:{slow.port}")
    result = run_python(target, Load("/", b"{}", 2, WINDOW))
    # Each connection sent one request in the window and waited DELAY for its answer.
    assert result.requests == 2 and result.errors == 0
    assert result.duration_s >= DELAY
    assert result.rps == pytest.approx(result.requests / result.duration_s)
    assert result.rps <= result.requests / DELAY
    assert result.as_dict()["duration_s"] == round(result.duration_s, 3)
