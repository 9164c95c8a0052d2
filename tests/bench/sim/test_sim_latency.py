"""The simulated engine's latency model: calibration, queueing, and aborts on disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.sim.engine import prefill_seconds
from bench.sim.media import MediaItem, image_tokens
from tests.procs import Proc, metric, running, scrape, sim_proc, wait_for

LONG = {"messages": [{"role": "user", "content": "Write a long essay."}],
        "max_tokens": 3000, "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    # One running slot, so a second request has to wait (calibrated latency).
    proc = sim_proc(tmp_path_factory.mktemp("latency"), "--max-num-seqs", "1")
    with running(proc):
        yield proc


# Reference medians (docs/vllm.md): image tokens, then TTFT for a new image and for the
# same image again. ~20 text tokens ride along with each image.
@pytest.mark.parametrize(
    ("side", "tokens", "new_ms", "cached_ms"),
    [(448, 200, 67.9, 31.8), (896, 790, 238.0, 32.7)],
)
def test_latency_model_matches_reference(
    side: int, tokens: int, new_ms: float, cached_ms: float
) -> None:
    image = image_tokens(side, side)
    assert abs(image - tokens) <= 0.02 * tokens
    prompt = image + 22
    new = sum(prefill_seconds(prompt, [MediaItem("image", b"", image, cached=False)]))
    # Cached: every full block is a hit; only the tail is computed.
    tail = prompt - (prompt - 1) // 16 * 16
    cached = sum(prefill_seconds(tail, [MediaItem("image", b"", image, cached=True)]))
    assert abs(new * 1000 - new_ms) < 0.05 * new_ms
    assert abs(cached * 1000 - cached_ms) < 0.05 * cached_ms


@pytest.mark.slow
def test_first_token_waits_for_the_model(sim: Proc) -> None:
    # Not a timing assertion: the calibrated engine reports a non-zero TTFT.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert HTTP.post(sim.url + "/v1/chat/completions", json=body, timeout=10).is_success
    assert metric(sim.url, "vllm:time_to_first_token_seconds_sum")


@pytest.mark.slow
def test_non_streaming_disconnect_aborts(sim: Proc) -> None:
    before = metric(sim.url, "sim:aborted_requests_total")
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(sim.url + "/v1/chat/completions", json=LONG, timeout=0.5)
    assert wait_for(lambda: metric(sim.url, "sim:aborted_requests_total") == before + 1)
    assert wait_for(lambda: metric(sim.url, "vllm:num_requests_running") == 0)


@pytest.mark.slow
def test_streaming_disconnect_aborts(sim: Proc) -> None:
    before = metric(sim.url, "sim:aborted_requests_total")
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", sim.url + "/v1/chat/completions", json={**LONG, "stream": True}) as r,
    ):
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    assert wait_for(lambda: metric(sim.url, "sim:aborted_requests_total") == before + 1)
    samples = scrape(sim.url + "/metrics")
    aborts = [
        v
        for (n, ls), v in samples.items()
        if n == "vllm:request_success_total" and ("finished_reason", "abort") in ls
    ]
    assert aborts and aborts[0] >= 1


@pytest.mark.slow
async def test_overload_queues_and_every_waiter_can_abort(sim: Proc) -> None:
    before = metric(sim.url, "sim:aborted_requests_total")
    async with httpx.AsyncClient(timeout=30) as client:
        tasks = [
            asyncio.create_task(client.post(sim.url + "/v1/chat/completions", json=LONG))
            for _ in range(3)
        ]
        seen = await asyncio.to_thread(
            wait_for,
            lambda: (
                metric(sim.url, "vllm:num_requests_waiting") == 2
                and metric(sim.url, "vllm:num_requests_running") == 1
            ),
        )
        load = (await client.get(sim.url + "/load")).json()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert seen
    assert load == {"server_load": 3}
    assert await asyncio.to_thread(
        wait_for, lambda: metric(sim.url, "sim:aborted_requests_total") == before + 3
    )
    assert metric(sim.url, "vllm:num_requests_waiting") == 0
    assert metric(sim.url, "vllm:num_requests_running") == 0
