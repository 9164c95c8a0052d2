"""`bench routing --real-vllm --sim-engines`: the real-engine workloads and front ends on
simulated engines (bench/suites/routing/sim_engines.py), each a `bench.sim` process on
loopback, restarted between front ends."""

from __future__ import annotations

from pathlib import Path

from bench.harness.realvllm.models import WORDS
from bench.sim.tokenizer import encode
from bench.suites.routing.real import (
    AFFINITY,
    IDEAL,
    RealOptions,
    parse_args,
    pool,
    run,
    run_front,
)
from bench.suites.routing.real_workloads import EVICTION, Sizes, build
from bench.suites.routing.sim_engines import SIM_TOKENS_PER_WORD, SimEngineSet, sim_kv_tokens

SIZES = Sizes(conversations=6, turns=(3, 4), requests=20, images=3, questions=2, sides=(112,))


def test_kv_is_scaled_to_the_simulators_tokens() -> None:
    """A word of the workloads is one token of the real models and about 1.34 of the
    simulator's (4 bytes a token), so the simulated KV holds the same prompts."""
    text = " ".join(WORDS * 40)
    assert abs(len(encode(text)) / (len(WORDS) * 40) - SIM_TOKENS_PER_WORD) < 0.01
    assert 1.2 < SIM_TOKENS_PER_WORD < 1.5
    for real in (128, 6144, 209_664):
        tokens = sim_kv_tokens(real)
        assert tokens % 128 == 0
        assert real * SIM_TOKENS_PER_WORD <= tokens < real * SIM_TOKENS_PER_WORD + 128


def test_the_option_runs_simulated_engines() -> None:
    opts, _ = parse_args(["--real-vllm", "--sim-engines"])
    assert opts.sim_engines
    assert not parse_args(["--real-vllm"])[0].sim_engines


def test_engines_count_serve_and_start_empty_again(tmp_path: Path) -> None:
    (workload,) = [build("chat", "llama-big", SIZES, 0)]
    engines = SimEngineSet("llama-big", 2, tmp_path, blocks=48).start()
    try:
        assert engines.kv_tokens() == [sim_kv_tokens(48 * 128)] * 2
        first = engines.urls
        opts = RealOptions(engines=2, sizes=SIZES, live=4)
        result = run_front(AFFINITY, workload, engines, opts, tmp_path)
        assert result is not None and result.errors == 0, result and result.first_error
        # The engines' own counters and recorders: every call counted and placed.
        assert sum(result.requests_per_engine) == result.calls > 0
        assert 0 < result.hit_rate < 1 and result.cold_cached == 0
        assert result.agreement is not None and result.follow_ups > 0
        assert all(e is not None for _, e, _, _, _, _ in result.sent)
        engines.reset()
        # New processes, nothing counted, nothing cached.
        assert engines.urls != first
        assert all(c.queries == 0 and c.requests == 0 for c in engines.counters())
    finally:
        engines.stop()
    assert engines.urls == []


def test_a_run_pools_each_front_end_and_the_ideal(tmp_path: Path) -> None:
    """Two simulated engines, chat with and without eviction, through affinity and
    straight to the ideal: every call answered, the ideal's hit rate the ceiling without
    eviction, and the eviction KV reaching the engines (less hit)."""
    opts = RealOptions(
        engines=2,
        sizes=SIZES,
        workloads=["chat", EVICTION],
        fronts=[f"={AFFINITY}", f"={IDEAL}"],
        live=4,
        sim_engines=True,
        # Room for about one system prompt an engine.
        evict_tokens=2048,
    )
    rows = {(r.front, r.workload): r for r in pool(run(opts, tmp_path))}
    assert set(rows) == {(f, w) for f in (AFFINITY, IDEAL) for w in opts.workloads}
    for r in rows.values():
        assert r.errors == 0, r.first_error
        assert len(r.ttfts) == r.calls and sum(r.requests_per_engine) == r.calls
        assert r.cold_cached == 0
    assert rows[(AFFINITY, "chat")].hit_rate <= rows[(IDEAL, "chat")].hit_rate + 1e-9
    # (Under eviction, one LRU cache of twice the size may thrash where two caches
    # partitioned by conversation do not: no ceiling there.)
    for front in (AFFINITY, IDEAL):
        assert rows[(front, EVICTION)].hit_rate < rows[(front, "chat")].hit_rate


def test_a_warm_up_is_served_first_and_left_out(tmp_path: Path) -> None:
    """With `--warm-up` the front end first serves conversations of its own under the
    same system prompts; the figures count only the measured conversations, which then
    find their system prompt cached from their first turn. Without it the first turn
    under each prompt finds nothing."""
    assert parse_args(["--real-vllm", "--warm-up"])[0].warm_up
    assert not parse_args(["--real-vllm"])[0].warm_up
    sizes = Sizes(conversations=4, systems=2, turns=(2, 3), warm_conversations=2, sides=(112,))
    cold, warm = (build("chat", "llama-big", sizes, 0, warm_up=w) for w in (False, True))
    assert warm.warmup == 2 and len(warm.sessions) == 6 and warm.cold_keys == frozenset()
    engines = SimEngineSet("llama-big", 1, tmp_path).start()
    try:
        opts = RealOptions(engines=1, sizes=sizes, live=4)
        found = {}
        for name, workload in (("cold", cold), ("warm", warm)):
            result = run_front(IDEAL, workload, engines, opts, tmp_path)
            assert result is not None and result.errors == 0, result and result.first_error
            measured = sum(len(s) for s in workload.measured)
            # The engine's own counter: the warm-up's requests left out.
            assert result.calls == measured == sum(result.requests_per_engine)
            assert {key for key, *_ in result.sent} == {f"conversation {i}" for i in range(4)}
            found[name] = result.nothing_cached
    finally:
        engines.stop()
    assert found == {"cold": 2, "warm": 0}
