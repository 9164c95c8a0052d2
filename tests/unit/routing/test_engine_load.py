"""An engine's load (gateway/routing/engine_load.py): its /metrics parsed, and the
load the pool reads from it."""

from __future__ import annotations

import math

import pytest

from gateway.routing.engine import Engine
from gateway.routing.engine_load import EngineLoad, RecentTokens, parse_load


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b'vllm:num_requests_waiting{model_name="m",engine="0"} 3\n', EngineLoad(3, 0.0)),
        (b"vllm:num_requests_waiting 4", EngineLoad(4, 0.0)),
        # Data-parallel ranks: queues add up, KV usage is the fullest rank's.
        (
            b'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 5\n'
            b'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.5',
            EngineLoad(7, 0.5),
        ),
        # HELP/TYPE lines and longer names with the same prefix are not samples.
        (
            b"# HELP vllm:num_requests_waiting 9\n# TYPE vllm:num_requests_waiting gauge\n"
            b'vllm:num_requests_waiting_by_reason{reason="x"} 100\n'
            b"vllm:num_requests_waiting 1 1700000000000\n",
            EngineLoad(1, 0.0),
        ),
        (b'vllm:kv_cache_usage_perc{a="} 9"} 0.75', EngineLoad(0, 0.75)),
        # Running requests (what every replica sends), summed over ranks like the queue.
        (
            b'vllm:num_requests_running{engine="0"} 6\nvllm:num_requests_running{engine="1"} 2\n'
            b"vllm:num_requests_waiting 1\n",
            EngineLoad(1, 0.0, 8),
        ),
        (b"vllm:num_requests_running 3", EngineLoad(0, 0.0, 3)),
        # Garbage values are skipped, never raised; out-of-range usage is clamped.
        (b"vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 7", EngineLoad(0, 1.0)),
        (b"vllm:num_requests_waiting -3\nvllm:num_requests_waiting abc", None),
        (b"not metrics at all", None),
        # Finite samples whose sum is past a float's range: read as the most there is.
        (
            b"vllm:num_requests_waiting 1e308\nvllm:num_requests_waiting 1e308\n"
            b"vllm:num_requests_running 1e308\nvllm:num_requests_running 1e308",
            EngineLoad(1_000_000, 0.0, 1_000_000),
        ),
        (b"", None),
    ],
)
def test_engine_load_parsing(text: bytes, expected: EngineLoad | None) -> None:
    assert parse_load(text) == expected


@pytest.mark.parametrize(
    ("in_flight", "running", "waiting", "scraped", "load"),
    [
        (3, 0, 0, False, 3),  # nothing read: this process's own count
        (3, 5, 2, True, 7),  # the engine's own count, which every replica reads alike
        (9, 5, 2, True, 9),  # more sent since the last read than the engine reported
        (0, 0, 0, True, 0),
    ],
)
def test_engine_load_is_what_the_engine_reports(
    in_flight: int, running: int, waiting: int, scraped: bool, load: int
) -> None:
    engine = Engine("http://10.0.0.1:8000")
    engine.in_flight, engine.running, engine.waiting, engine.scraped = (
        in_flight, running, waiting, scraped
    )  # fmt: skip
    assert engine.load == load


@pytest.mark.parametrize(
    ("in_flight", "running", "waiting", "mine_at_scrape", "scraped", "busy", "load"),
    [
        (2, 0, 0, 0, False, 2, 2),  # nothing read: this process's own count
        # This process's one request, scraped running, has ended: idle now (the load bound
        # still reads the scrape).
        (0, 1, 0, 1, True, 0, 1),
        # Another process's request, scraped: still counted until the next scrape.
        (0, 1, 0, 0, True, 1, 1),
        # One of ours ended, one of another's runs, one of ours was sent since.
        (1, 2, 0, 1, True, 2, 2),
        (3, 1, 1, 1, True, 4, 3),
        # More of ours at the scrape than the engine had taken in: no one else's.
        (1, 0, 0, 2, True, 1, 1),
    ],
)
def test_busy_counts_this_process_now_and_the_others_as_scraped(
    in_flight: int,
    running: int,
    waiting: int,
    mine_at_scrape: int,
    scraped: bool,
    busy: int,
    load: int,
) -> None:
    engine = Engine("http://10.0.0.1:8000")
    engine.in_flight, engine.running, engine.waiting = in_flight, running, waiting
    engine.mine_at_scrape, engine.scraped = mine_at_scrape, scraped
    assert (engine.busy, engine.load) == (busy, load)


@pytest.mark.parametrize(
    ("text", "recomputed"),
    [
        # vLLM's prefix-cache counters: queries less hits, summed over label sets.
        (
            b'vllm:num_requests_running 0\nvllm:prefix_cache_queries_total{engine="0"} 900\n'
            b'vllm:prefix_cache_hits_total{engine="0"} 600\n'
            b'vllm:prefix_cache_queries_total{engine="1"} 100\n',
            400.0,
        ),
        # The counters' `_created` companions and HELP lines are not samples.
        (
            b"# HELP vllm:prefix_cache_queries_total 9\nvllm:num_requests_waiting 0\n"
            b"vllm:prefix_cache_queries_created 1700000000\nvllm:prefix_cache_queries_total 50\n"
            b"vllm:prefix_cache_hits_total 20",
            30.0,
        ),
        (b"vllm:num_requests_waiting 1", None),  # no counters: not measured
        # Hits past queries (a torn read across label sets) is nothing recomputed.
        (
            b"vllm:num_requests_waiting 0\nvllm:prefix_cache_queries_total 5\n"
            b"vllm:prefix_cache_hits_total 9",
            0.0,
        ),
    ],
)
def test_recomputed_tokens_are_the_prefix_caches_queries_less_hits(
    text: bytes, recomputed: float | None
) -> None:
    load = parse_load(text)
    assert load is not None
    assert load.recomputed == recomputed


def test_recent_tokens_count_the_counters_growth_decaying() -> None:
    """The first reading is a baseline (an engine's history before this process saw it
    counts nothing); later growth adds, decaying with the time constant; a counter that
    goes back (the engine restarted) counts from zero."""
    recent = RecentTokens()
    assert not recent.known
    assert recent.value(0.0) == 0.0
    recent.observe(5000.0, 0.0, 10.0)
    assert recent.known
    assert recent.value(0.0) == 0.0
    recent.observe(5300.0, 1.0, 10.0)
    assert recent.value(1.0) == pytest.approx(300.0)
    assert recent.value(11.0) == pytest.approx(300.0 * math.exp(-1))
    recent.observe(5300.0, 11.0, 10.0)  # nothing new: decayed only
    assert recent.value(11.0) == pytest.approx(300.0 * math.exp(-1))
    recent.observe(40.0, 11.0, 10.0)  # restarted: 40 since
    assert recent.value(11.0) == pytest.approx(300.0 * math.exp(-1) + 40.0)
