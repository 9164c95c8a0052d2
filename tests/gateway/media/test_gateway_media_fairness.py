"""Fetch slots shared fairly between keys, through the gateway under uvicorn: one key
floods a slow loopback origin, another key's single image is not queued behind it.

With one FIFO semaphore of two slots, key B's image waited for the ten of A's fetches
queued before it: five rounds of the origin's delay (issue 13 measured ~3 s with
twelve requests). A freed slot now goes to the waiting key holding the fewest, so B
waits for one slot to free up, then for its own fetch.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.samples import png
from tests.procs import (
    RecordingServer,
    Route,
    ask_about_image,
    gateway_proc,
    media_gateway_env,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

A = "sk-fetch-fair-a-0123456789abcdef"
B = "sk-fetch-fair-b-0123456789abcdef"
DELAY = 1.0  # the origin's answer time for every image
SLOTS = 2
FLOOD = 12


def test_one_keys_flood_does_not_queue_another_keys_image(tmp_path: Path) -> None:
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
                started = time.monotonic()
                answer = ask(B, 1000)
                b_elapsed = time.monotonic() - started
                a_done_by_then = len(a_done)
                statuses = [f.result().status_code for f in flood]
            assert answer.status_code == 200, answer.text
            assert statuses == [200] * FLOOD
            # Fair: one slot to free (at most DELAY) and B's own fetch (DELAY), with
            # room for a loaded machine. FIFO: (FLOOD - SLOTS) / SLOTS more rounds of
            # DELAY, 5 s here, plus B's own fetch.
            assert b_elapsed < 3.5 * DELAY
            # A's flood was still queued when B was answered.
            assert a_done_by_then <= FLOOD // 2
            assert sim_received(sim.url) - before == FLOOD + 1
