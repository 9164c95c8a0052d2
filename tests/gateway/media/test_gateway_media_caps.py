"""The fetch time and concurrency caps through the gateway under uvicorn: a slow media
origin on loopback, and one that counts how many fetches it serves at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from bench.samples import png
from tests.procs import (
    Proc,
    ask_about_image,
    gateway_proc,
    media_gateway_env,
    running,
    sim_proc,
    sim_received,
)

KEY = "sk-media-caps-0123456789abcdef"
PNG = png(16, 16)
FETCH_TIMEOUT = 0.5
MAX_CONCURRENT = 2


class CountingOrigin:
    """Serves PNG after `delay` seconds; `/slow...` sleeps 3 s and answers nothing.
    Records the largest number of (not slow) requests in progress at once."""

    def __init__(self, delay: float) -> None:
        self.served = 0
        self.in_progress = 0
        self.most = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                slow = self.path.startswith("/slow")
                if slow:  # still asleep after the gateway gave up: not counted
                    time.sleep(3.0)
                    return
                with lock:
                    outer.in_progress += 1
                    outer.most = max(outer.most, outer.in_progress)
                try:
                    time.sleep(delay)
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(PNG)))
                    self.end_headers()
                    self.wfile.write(PNG)
                except OSError:
                    pass  # the gateway gave up and closed the connection
                finally:
                    with lock:
                        outer.in_progress -= 1
                        outer.served += 1

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Stack:
    sim: Proc
    gateway: Proc
    origin: CountingOrigin


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("caps")
    # Three waves of two 0.1 s fetches fit in the 0.5 s cap, which also counts the wait
    # for a fetch slot (docs/media.md).
    origin = CountingOrigin(delay=0.1)
    sim = sim_proc(tmp, "--latency", "zero")
    env = media_gateway_env(
        sim.url,
        KEY,
        f"127.0.0.1:{origin.port}",
        "http",
        GATEWAY_MEDIA__FETCH_TIMEOUT=str(FETCH_TIMEOUT),
        GATEWAY_MEDIA__MAX_CONCURRENT_FETCHES=str(MAX_CONCURRENT),
    )
    gateway = gateway_proc(tmp, env)
    try:
        with running(sim), running(gateway, ready_path="/readyz"):
            yield Stack(sim, gateway, origin)
    finally:
        origin.close()


def _chat(stack: Stack, path: str) -> httpx.Response:
    image = f"http://127.0.0.1:{stack.origin.port}{path}"
    return ask_about_image(stack.gateway.url, KEY, image)


def test_a_fetch_over_its_time_is_cut_and_refused(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    start = time.monotonic()
    resp = _chat(stack, "/slow.png")
    elapsed = time.monotonic() - start
    assert resp.status_code == 422
    assert resp.json()["error"]["code"] == "media_fetch_failed"
    assert "reason: timeout" in resp.json()["error"]["message"]
    # Cut at the cap, not when the origin answered (3 s).
    assert elapsed < 2.5
    assert sim_received(stack.sim.url) == before


def test_fetches_run_at_most_the_cap_at_once(stack: Stack) -> None:
    """Six requests at once, each with its own image (nothing cached): the origin never
    serves more than MAX_CONCURRENT_FETCHES of them at a time, and every request is
    answered."""
    before = sim_received(stack.sim.url)
    served = stack.origin.served
    stack.origin.most = 0
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: _chat(stack, f"/img{i}.png"), range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert stack.origin.served - served == 6
    assert stack.origin.most == MAX_CONCURRENT
    assert sim_received(stack.sim.url) - before == 6
