"""The real-engine routing suite (`bench routing --real-vllm`) in its smallest form: two
tiny-llama engines, the chat workload's tiny sizes, affinity, round robin and the ideal
engine, the fleet's front ends run twice and pooled. The figures come from the engines'
own counters; the caches are reset between front ends, so the calls that share nothing
with an earlier call of the run find nothing cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.realvllm.home import Home
from bench.harness.realvllm.models import CHAT, MULTIMODAL_SMALL
from bench.harness.redis_server import redis_server_path
from bench.suites.routing.engine_set import EngineSet
from bench.suites.routing.real import (
    AFFINITY,
    IDEAL,
    ROUND_ROBIN,
    STORE,
    RealOptions,
    pool,
    run,
)
from bench.suites.routing.real_workloads import FULL, TINY

pytestmark = pytest.mark.real_vllm


def test_smallest_run(real_home: Home, tmp_path: Path) -> None:
    opts = RealOptions(
        engines=2,
        sizes=TINY,
        workloads=["chat"],
        fronts=[AFFINITY, ROUND_ROBIN, IDEAL],
        live=4,
        chat_model=CHAT,
        # tiny-llama's own context (2,048 tokens).
        max_model_len=None,
        # Each front end twice, the order rotated; the ideal engine once.
        repeats=2,
    )
    runs = run(opts, tmp_path)
    fleet = [r.front for r in runs if r.front != IDEAL]
    half = len(fleet) // 2
    assert fleet[half:] == [*fleet[1:half], fleet[0]] and [r.front for r in runs].count(IDEAL) == 1
    results = pool(runs)
    rows = {r.front: r for r in results}
    # "affinity" also names the hot_divisor row, which runs on the eviction workload only,
    # and the store's row, which runs where redis-server is installed (checked below
    # like every row when it ran).
    assert sorted(set(rows) - {STORE}) == sorted([AFFINITY, ROUND_ROBIN, IDEAL])
    assert (STORE in rows) == (redis_server_path() is not None)
    calls = sum(len(s) for s in _chat_sessions(opts))
    for r in results:
        assert r.workload == "chat"
        assert r.errors == 0, r.first_error
        assert r.calls == calls * r.runs and r.runs == (1 if r.front == IDEAL else 2)
        assert len(r.ttfts) == r.calls and len(r.run_p99_ms) == r.runs
        # vLLM's counters: every call queried the cache, and the shared system prompts hit.
        assert 0 < r.hit_rate < 1
        assert sum(r.requests_per_engine) == r.calls
        # Reset before each front end: the first call under each system prompt finds
        # nothing cached (the front end before left every system prompt cached).
        assert r.cold_cached == 0
    assert len(rows[AFFINITY].uncached_per_engine) == 2
    assert len(rows[IDEAL].uncached_per_engine) == 1
    # The request logs tell where each turn went; the gateway passes X-Request-Id on.
    assert rows[AFFINITY].agreement is not None and rows[AFFINITY].follow_ups > 0
    assert rows[ROUND_ROBIN].agreement is not None


def test_a_multimodal_fleet_is_warmed_at_every_image_shape(real_home: Home) -> None:
    """A fresh engine's vision tower is slow at each image shape's first use, which
    would fall on the first front end of a run: the fleet's start sends an image of
    every shape the workloads use (and three text prompts), then resets the caches."""
    engines = EngineSet(MULTIMODAL_SMALL, 1, home=real_home).start()
    try:
        (counted,) = engines.counters()
        assert counted.requests == 3 + len(FULL.sides) ** 2
    finally:
        engines.stop()


def _chat_sessions(opts: RealOptions) -> list[list[object]]:
    from bench.suites.routing.real_workloads import build

    return list(build("chat", opts.models[0], opts.sizes, opts.seed).sessions)
