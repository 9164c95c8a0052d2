"""Shared fixtures. Area-specific fixtures live in the test modules that use them."""

from __future__ import annotations

import getpass
import tempfile
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import httpx
import pytest
import structlog

from tests.procs import Proc, RecordingServer, sim_proc


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish() -> None:
    """Remove pytest's per-user folder in the temporary directory once it is empty: the
    retention policy (pyproject.toml) removes a passing run's own folder, not its parent.
    A folder another run still uses is not empty and stays."""
    with suppress(OSError):
        Path(tempfile.gettempdir(), f"pytest-of-{getpass.getuser()}").rmdir()


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """A test that configures logging (`configure_logging`) binds structlog to the
    output pytest captured for it, closed once the test ends: later tests log through
    structlog's defaults again, not into that closed file."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start simulated engines: `start_sim("--runner", "pooling")`; stopped at teardown."""
    started: list[Proc] = []

    def start(*opts: str) -> Proc:
        proc = sim_proc(tmp_path, *opts).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def client(sim: Proc) -> Iterator[httpx.Client]:
    """A client of the module's `sim` fixture (a simulated engine the module starts)."""
    with httpx.Client(base_url=sim.url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def canary() -> Iterator[RecordingServer]:
    """A loopback HTTP server that must never be contacted (one per test module)."""
    with RecordingServer() as server:
        yield server
