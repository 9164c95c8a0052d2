"""The fetch time and concurrency caps through the gateway under uvicorn: a slow media
origin on loopback, and one that counts how many fetches it serves at once; and the
fetch slots shared fairly between keys."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from bench.harness.samples import png
from tests.procs import (
    MediaStack,
    RecordingServer,
    Route,
    ask_about_image,
    free_port,
    gateway_proc,
    media_gateway_env,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

KEY = "sk-media-caps-0123456789abcdef"
PNG = png(16, 16)
# The cap counts the wait for a fetch slot too (docs/media.md): three waves of two
# fetches of FETCH_DELAY each fit in it many times over, even on a loaded machine.
FETCH_TIMEOUT = 3.0
FETCH_DELAY = 0.25
MAX_CONCURRENT = 2
# What the slow origin takes to (not) answer: a fetch still waiting then was not cut.
SLOW = 10 * FETCH_TIMEOUT


class CountingOrigin:
    """Serves PNG after `delay` seconds; `/slow...` sleeps SLOW seconds (well past the
    fetch cap) and answers nothing.
    Records the largest number of (not slow) fetches in progress at once.

    A fetch counts from its arrival until the origin starts answering it. The gateway
    frees its slot only after reading the answer, so a fetch it starts in a freed slot
    always arrives after the one before has stopped counting: the figure is never above
    the concurrency the gateway exerts. (Counting until the answer had been written let
    the next fetch arrive while the thread that answered the last one had not yet
    counted it finished: three at once, with a cap of two.)
    """

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
                    time.sleep(SLOW)
                    return
                with lock:
                    outer.in_progress += 1
                    outer.most = max(outer.most, outer.in_progress)
                time.sleep(delay)
                with lock:
                    outer.in_progress -= 1
                    outer.served += 1
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(PNG)))
                    self.end_headers()
                    self.wfile.write(PNG)
                except OSError:
                    pass  # the gateway gave up and closed the connection

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


Stack = MediaStack[CountingOrigin]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("caps")
    origin = CountingOrigin(delay=FETCH_DELAY)
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


@pytest.mark.slow
def test_a_fetch_over_its_time_is_cut_and_refused(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    resp = _chat(stack, "/slow.png")
    assert resp.status_code == 422
    assert resp.json()["error"]["code"] == "media_fetch_failed"
    # Cut by the cap: the origin closes without an answer only after SLOW seconds, a
    # fetch that outlived the cap would fail for another reason (or the client's wait).
    assert "reason: timeout" in resp.json()["error"]["message"]
    assert sim_received(stack.sim.url) == before


@pytest.mark.slow
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
    # Never above the cap; six requests sent at once overlap at the origin, unless a
    # loaded machine spaces them out by more than FETCH_DELAY.
    assert 1 <= stack.origin.most <= MAX_CONCURRENT
    assert sim_received(stack.sim.url) - before == 6


# Fairness: one key floods a slow origin, another key's single image is not queued
# behind it.
A = "sk-fetch-fair-a-0123456789abcdef"
B = "sk-fetch-fair-b-0123456789abcdef"
DELAY = 1.0  # the origin's answer time for every image
SLOTS = 2
FLOOD = 12


@pytest.mark.slow
def test_one_keys_flood_does_not_queue_another_keys_image(tmp_path: Path) -> None:
    """Fetch slots shared fairly between keys, through the gateway under uvicorn: one key
    floods a slow loopback origin, another key's single image is not queued behind it.

    With one FIFO semaphore of two slots, key B's image waited for the ten of A's fetches
    queued before it: five rounds of the origin's delay (an attacker measured ~3 s with
    twelve requests). A freed slot now goes to the waiting key holding the fewest, so B
    waits for one slot to free up, then for its own fetch.
    """
    png_route = Route(body=png(16, 16), headers={"Content-Type": "image/png"}, delay=DELAY)
    with RecordingServer({"/img.png": png_route}) as origin:
        sim = sim_proc(tmp_path, "--latency", "zero")
        env = media_gateway_env(
            sim.url,
            A,
            f"127.0.0.1:{origin.port}",
            "http",
            GATEWAY_API_KEYS=json.dumps([A, B]),
            GATEWAY_MEDIA__MAX_CONCURRENT_FETCHES=str(SLOTS),
            # Long enough for A's whole flood: nothing here is cut by the time cap.
            GATEWAY_MEDIA__FETCH_TIMEOUT="60",
        )
        gateway = gateway_proc(tmp_path, env)
        with running(sim), running(gateway, ready_path="/readyz"):
            before = sim_received(sim.url)
            a_done: list[float] = []

            def ask(key: str, n: int) -> httpx.Response:
                # A distinct URL each time: nothing is answered from the media cache.
                return ask_about_image(gateway.url, key, f"{origin.url}/img.png?n={n}")

            def flood_one(n: int) -> httpx.Response:
                resp = ask(A, n)
                a_done.append(time.monotonic())
                return resp

            with ThreadPoolExecutor(FLOOD) as pool:
                flood = [pool.submit(flood_one, n) for n in range(FLOOD)]
                # A's first fetches hold both slots, the rest of its flood is queued.
                assert wait_for(lambda: len(origin.hits) >= SLOTS, timeout=10)
                time.sleep(0.3)
                answer = ask(B, 1000)
                a_done_by_then = len(a_done)
                statuses = [f.result().status_code for f in flood]
            assert answer.status_code == 200, answer.text
            assert statuses == [200] * FLOOD
            # Fair: B's fetch reaches the origin in the first freed slot, after SLOTS of
            # A's (a few more if a loaded machine was slow to queue it). FIFO: after all
            # FLOOD of A's, queued before it.
            arrived = [hit.path for hit in origin.hits]
            assert arrived.index("/img.png?n=1000") <= FLOOD // 2, arrived
            # A's flood was still queued when B was answered.
            assert a_done_by_then <= FLOOD // 2
            assert sim_received(sim.url) - before == FLOOD + 1
