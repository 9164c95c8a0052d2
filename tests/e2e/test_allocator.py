"""Memory the gateway has freed goes back to the system: large blocks at once (a fixed
mmap threshold, tested with the decode-heavy requests in tests/e2e/), and what
piles up in malloc's arenas within `TRIM_INTERVAL` seconds."""

from __future__ import annotations

import json
import platform
import socket
import threading
from pathlib import Path

import pytest

from gateway.config.settings import LimitsSettings
from gateway.server.process import TRIM_INTERVAL
from tests.procs import Proc, auth, gateway_proc, running, sim_proc, sim_received, wait_for

KEY = "sk-allocator-0123456789abcdef"
CHUNK = 64 * 1024
# Chunks a body sends: past the body cap, so each is refused once it is read that far.
CHUNKS = LimitsSettings().max_body_bytes // CHUNK + 8

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


def _mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _oversized_chunked_body(gateway: Proc) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: {auth(KEY)['Authorization']}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", gateway.port)) as conn:
        conn.sendall(head.encode())
        piece = f"{CHUNK:x}\r\n".encode() + b"a" * CHUNK + b"\r\n"
        try:
            for _ in range(CHUNKS):
                conn.sendall(piece)
        except OSError:
            pass  # refused at the cap: the gateway closed the connection


@pytest.mark.slow
def test_memory_of_refused_bodies_goes_back_to_the_system(tmp_path: Path) -> None:
    """Twelve chunked bodies over the cap at once, twice: the arenas they were read into
    are given back within a trim interval (without the trim: 60 -> 166 MiB, kept)."""
    sim = sim_proc(tmp_path, "--latency", "zero")
    env = {"GATEWAY_ENGINES": json.dumps([sim.url]), "GATEWAY_API_KEYS": json.dumps([KEY])}
    gateway = gateway_proc(tmp_path, env)
    with running(sim), running(gateway, ready_path="/readyz"):
        assert gateway.pid is not None
        pid = gateway.pid
        start = _mib(pid)
        for _ in range(2):
            senders = [
                threading.Thread(target=_oversized_chunked_body, args=(gateway,)) for _ in range(12)
            ]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join()
        peak = _mib(pid, "VmHWM")
        assert peak > start + 40, (start, peak)  # the bodies were read into memory
        assert wait_for(lambda: _mib(pid) < start + 20, timeout=TRIM_INTERVAL + 10), (
            start,
            peak,
            _mib(pid),
        )
        assert sim_received(sim.url) == 0
