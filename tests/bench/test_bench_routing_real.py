"""The real-engine routing suite's workloads and report (bench/suites/routing/real*.py),
without engines; the run itself is in tests/real/test_routing_real.py."""

from __future__ import annotations

import base64
import io
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from bench.harness.realvllm.models import WORDS
from bench.harness.redis_server import redis_server_path
from bench.sim.cache import PrefixCache
from bench.suites.fleet import CpuPlan, Fleet
from bench.suites.report import Report
from bench.suites.routing.engine_set import EngineSet, engine_dtype
from bench.suites.routing.real import (
    AFFINITY,
    BASELINE,
    BASELINE_STORE,
    CACHE_AWARE,
    DIRECT,
    HOT1,
    IDEAL,
    LEAST_LOADED,
    ROUND_ROBIN,
    STARTERS,
    STORE,
    RealOptions,
    RealResult,
    SlowCall,
    cold_cached,
    front_order,
    fronts_for,
    max_over_mean,
    model_pair,
    nothing_cached,
    p99_gap_interval,
    parse_args,
    percentile,
    pool,
    run_ttfts,
    sent_calls,
    slowest_calls,
)
from bench.suites.routing.real_offline import (
    BLOCK,
    prompt_blocks,
    run_offline,
    write_offline_report,
)
from bench.suites.routing.real_report import PEERS, write_real_report
from bench.suites.routing.real_workloads import EVICTION, FULL, QUICK, TINY, Sizes, build

SMALL = Sizes(conversations=8, requests=40, images=3, questions=2, sides=(112, 168))


def _messages(call_body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = call_body["messages"]
    return messages


@pytest.mark.parametrize("name", ["chat", "few_shot", "images", EVICTION])
def test_workloads_are_the_same_for_a_seed_and_differ_between_seeds(name: str) -> None:
    one = build(name, "m", SMALL, seed=3)
    assert one == build(name, "m", SMALL, seed=3)
    assert one.sessions != build(name, "m", SMALL, seed=4).sessions
    for session in one.sessions:
        for call in session:
            assert call.path == "/v1/chat/completions" and call.key is not None
            assert call.body["stream"] is True and call.body["model"] == "m"
            # The engines report each call's cached tokens in the stream's usage.
            assert call.body["stream_options"] == {"include_usage": True}
            assert not call.follow_up


def test_eviction_workload_is_the_chat_workload_renamed() -> None:
    chat, evict = build("chat", "m", SMALL, 1), build(EVICTION, "m", SMALL, 1)
    assert evict.name == EVICTION and evict.sessions == chat.sessions


def test_chat_turns_send_the_conversation_back_under_four_shared_system_prompts() -> None:
    chat = build("chat", "m", FULL, seed=0)
    assert len(chat.sessions) == 36
    systems = Counter(_messages(s[0].body)[0]["content"] for s in chat.sessions)
    assert len(systems) == 4 and set(systems.values()) == {9}
    for session in chat.sessions:
        assert 6 <= len(session) <= 10
        assert len({c.key for c in session}) == 1
        for turn, call in enumerate(session):
            messages = _messages(call.body)
            assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * turn + [
                "user"
            ]
            # Each turn is the previous turn's prompt, its reply, and a new question.
            if turn:
                before = _messages(session[turn - 1].body)
                assert messages[: len(before)] == before
        # 1,000-2,000 words of the models' word list: one token each.
        system_words = _messages(session[0].body)[0]["content"].split()[3:]
        assert 1000 <= len(system_words) <= 2000 and set(system_words) <= set(WORDS)


def test_few_shot_templates_have_zipf_popularity() -> None:
    work = build("few_shot", "m", FULL, seed=0)
    assert len(work.sessions) == 240 and all(len(s) == 1 for s in work.sessions)
    counts = Counter(s[0].key for s in work.sessions)
    ranked = [n for _, n in counts.most_common()]
    # Zipf 1.1 over 12 templates: the top one about a third, the least about 2%.
    assert len(counts) == 12 and ranked[0] > 3 * ranked[-1] and 0.2 < ranked[0] / 240 < 0.45


def test_images_are_pngs_asked_several_questions() -> None:
    work = build("images", "m", QUICK, seed=0)
    assert len(work.sessions) == QUICK.images * QUICK.questions
    assert set(Counter(s[0].key for s in work.sessions).values()) == {QUICK.questions}
    urls = {
        part["image_url"]["url"]
        for s in work.sessions
        for part in _messages(s[0].body)[1]["content"]
        if part["type"] == "image_url"
    }
    assert len(urls) == QUICK.images
    for url in urls:
        assert url.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert image.format == "PNG" and max(image.size) <= 672 and min(image.size) >= 448


def test_cold_keys_are_the_calls_that_share_no_block_with_an_earlier_one() -> None:
    chat = build("chat", "m", SMALL, seed=0)
    assert chat.cold_keys == {f"conversation {i}" for i in range(4)}
    firsts = [_messages(s[0].body)[0]["content"] for s in chat.sessions]
    # The cold ones open first, each under its own system prompt.
    assert len(set(firsts[:4])) == 4 and set(firsts[4:]) <= set(firsts[:4])
    # Their first calls may be in flight beside a call sharing their first blocks.
    assert build("few_shot", "m", SMALL).cold_keys == build("images", "m", SMALL).cold_keys == set()
    assert build(EVICTION, "m", SMALL, seed=0).cold_keys == chat.cold_keys


def test_cold_cached_sums_the_first_call_of_each_cold_key() -> None:
    calls = [("r0", "a"), ("r1", "b"), ("r2", "a"), ("r3", "c")]
    cached = {"r0": 0, "r1": 128, "r2": 512, "r3": 256}
    # r2 is a's second call: it may hit; c is not cold.
    assert cold_cached(calls, cached, frozenset({"a", "b"})) == 128
    assert cold_cached(calls, {"r0": 0, "r2": 5}, frozenset({"a"})) == 0
    # A cold call without usage: unknown, not 0.
    assert cold_cached(calls, {"r0": 0}, frozenset({"a", "b"})) is None
    assert cold_cached(calls, cached, frozenset()) is None


def test_tiny_sizes_fit_tiny_llamas_context() -> None:
    chat = build("chat", "m", TINY, seed=0)
    longest = max(len(" ".join(str(m["content"]) for m in _messages(c.body)).split())
                  for s in chat.sessions for c in s)  # fmt: skip
    assert longest < 1500


def test_hot_divisor_row_runs_on_the_eviction_workload_only() -> None:
    opts = RealOptions()
    assert HOT1 in fronts_for(EVICTION, opts) and HOT1 not in fronts_for("chat", opts)
    assert IDEAL not in fronts_for("chat", opts)
    # A name prefix selects: "affinity" takes every affinity row.
    assert fronts_for(EVICTION, RealOptions(fronts=["affinity"])) == [AFFINITY, STORE, HOT1]
    # `=NAME`: that front end alone.
    only = RealOptions(fronts=["=affinity", "=affinity + store", "ideal"])
    assert fronts_for(EVICTION, only) == [AFFINITY, STORE]
    assert fronts_for(EVICTION, RealOptions(fronts=["=affin"])) == []
    assert STORE in fronts_for("few_shot", opts)


def test_the_direct_row_runs_only_when_named(tmp_path: Path) -> None:
    """`--front direct`: each call straight to the next engine in turn (the client
    alternates over the URLs it is given), for the engines' own times of the same
    calls. Never part of the default suite, never a peer in the tail goal."""
    assert DIRECT not in fronts_for("chat", RealOptions())
    assert DIRECT not in fronts_for("chat", RealOptions(fronts=["affinity", "vllm"]))
    opts, _ = parse_args(["--real-vllm", "--front", "direct", "--front", "=affinity + store"])
    assert fronts_for("chat", opts) == [STORE, DIRECT]
    assert fronts_for(EVICTION, opts) == [STORE, DIRECT]
    engines = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    with Fleet(tmp_path, CpuPlan(None, None)) as fleet:
        assert STARTERS[DIRECT](fleet, engines, opts) == (engines, {})
    assert DIRECT not in PEERS
    # Its row is in the summary, and a faster tail than the peers' grades nothing.
    results = [
        _row(STORE, "chat", 0.89, 600.0, 1.1),
        _row(CACHE_AWARE, "chat", 0.86, 590.0, 1.5),
        _row(DIRECT, "chat", 0.83, 500.0, 1.0),
    ]
    report = Report.create("routing --real-vllm", tmp_path)
    write_real_report(report, results)
    assert report.tables[0].columns == ["workload", STORE, CACHE_AWARE, DIRECT]
    tail = next(g for g in report.goals if g.name == f"chat: {STORE} TTFT p99 vs the best peer's")
    assert tail.target == f"<= {CACHE_AWARE}'s"


def test_baseline_rows_run_only_with_a_baseline_tree(tmp_path: Path) -> None:
    """`--baseline-tree DIR` adds the affinity rows from that checkout, next to this
    one's; without it they are not run, whatever `--front` asks for."""
    assert BASELINE not in fronts_for("chat", RealOptions(fronts=["affinity"]))
    opts, _ = parse_args(["--real-vllm", "--baseline-tree", str(tmp_path), "--front", "affinity"])
    assert opts.baseline_tree == tmp_path
    assert fronts_for("chat", opts) == [AFFINITY, STORE, BASELINE, BASELINE_STORE]
    assert fronts_for(EVICTION, opts) == [AFFINITY, STORE, BASELINE, BASELINE_STORE, HOT1]


def test_quick_option_takes_two_engines_and_the_quick_sizes() -> None:
    opts, _ = parse_args(["--real-vllm", "--quick", "--seed", "7", "--workload", "chat"])
    assert (opts.engines, opts.sizes, opts.seed, opts.workloads) == (2, QUICK, 7, ["chat"])
    opts, _ = parse_args(["--real-vllm"])
    assert (opts.engines, opts.sizes) == (3, FULL)


_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
_AMX = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


@pytest.mark.parametrize(
    ("requested", "cpuinfo", "expected"),
    [
        ("auto", _AVX2, "float32"),
        ("auto", _AMX, "bfloat16"),
        ("auto", "flags\t\t: avx512f avx512_bf16\n", "bfloat16"),
        # AVX-512 alone has no bfloat16 arithmetic.
        ("auto", "flags\t\t: avx2 avx512f avx512bw\n", "float32"),
        ("auto", "", "float32"),
        ("bfloat16", _AVX2, "bfloat16"),
        ("float32", _AMX, "float32"),
    ],
)
def test_engines_compute_in_bfloat16_only_where_the_cpu_does_it_natively(
    requested: str, cpuinfo: str, expected: str
) -> None:
    assert engine_dtype(requested, cpuinfo) == expected


def test_dtype_option_reaches_the_engines_command_line() -> None:
    opts, _ = parse_args(["--real-vllm", "--dtype", "bfloat16"])
    assert opts.dtype == "bfloat16"
    assert parse_args(["--real-vllm"])[0].dtype == "auto"
    args = EngineSet("llama-big", 3, dtype=opts.dtype)._engine(0).args
    assert args[args.index("--dtype") + 1] == "bfloat16"


SPINNING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def test_executor_option_reaches_the_fleet_engines_environment() -> None:
    """uni (the default): the fleet's engines run the model in the engine core's process,
    without vLLM's worker process that spins after each step; mp: vLLM's own layout. The
    ideal engine keeps the worker, which binds its threads to every CPU."""
    assert parse_args(["--real-vllm"])[0].executor == "uni"
    assert parse_args(["--real-vllm", "--executor", "mp"])[0].executor == "mp"
    fleet = EngineSet("llama-small", 3)
    assert [fleet._engine(i).env.get(SPINNING) for i in range(3)] == ["0", "0", "0"]
    assert SPINNING not in EngineSet("llama-small", 3, executor="mp")._engine(0).env
    assert SPINNING not in EngineSet("llama-small", 3, ideal=True)._engine(0).env


@pytest.mark.parametrize(
    ("size", "dtype", "expected"),
    [
        ("auto", "bfloat16", ("llama-big", "qwen2vl-big")),
        ("auto", "float32", ("llama-small", "qwen2vl-small")),
        ("big", "float32", ("llama-big", "qwen2vl-big")),
        ("small", "bfloat16", ("llama-small", "qwen2vl-small")),
    ],
)
def test_the_models_are_big_where_the_engines_compute_bfloat16(
    size: str, dtype: str, expected: tuple[str, str]
) -> None:
    assert model_pair(size, dtype) == expected


def test_size_option_picks_the_fleets_models() -> None:
    opts, _ = parse_args(["--real-vllm", "--size", "small", "--dtype", "bfloat16"])
    assert opts.models == ("llama-small", "qwen2vl-small")
    opts, _ = parse_args(["--real-vllm", "--dtype", "float32"])
    assert opts.size == "auto" and opts.models == ("llama-small", "qwen2vl-small")
    opts, _ = parse_args(["--real-vllm", "--dtype", "bfloat16"])
    assert opts.models == ("llama-big", "qwen2vl-big")
    # The real tier's tiny models override the size's.
    opts = RealOptions(chat_model="tiny-llama", dtype="float32")
    assert opts.models == ("tiny-llama", "qwen2vl-small")


def test_gateway_env_option_takes_gateway_settings_only(capsys: pytest.CaptureFixture[str]) -> None:
    opts, _ = parse_args(
        ["--real-vllm", "--gateway-env", "GATEWAY_ROUTING__LOAD_INTERVAL=0",
         "--gateway-env", "GATEWAY_ROUTING__HOT_DIVISOR=2"]
    )  # fmt: skip
    assert opts.gateway_env == {
        "GATEWAY_ROUTING__LOAD_INTERVAL": "0",
        "GATEWAY_ROUTING__HOT_DIVISOR": "2",
    }
    assert parse_args(["--real-vllm"])[0].gateway_env == {}
    for bad in ("PATH=/tmp", "GATEWAY_ROUTING__POLICY"):
        with pytest.raises(SystemExit):
            parse_args(["--real-vllm", "--gateway-env", bad])
        assert "GATEWAY_NAME=value" in capsys.readouterr().err


def test_percentile_and_balance() -> None:
    values = [i / 1000 for i in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50) and percentile(values, 99) == 99
    assert percentile([], 50) is None
    assert max_over_mean([1.0, 1.0, 4.0]) == 2.0 and max_over_mean([5.0]) is None


def _row(front: str, workload: str, hit: float, p99: float | None, balance: float) -> RealResult:
    return RealResult(
        front=front,
        workload=workload,
        hit_rate=hit,
        queries=1000.0,
        uncached=1000 * (1 - hit),
        uncached_per_engine=[],
        requests_per_engine=[],
        uncached_max_over_mean=balance,
        requests_max_over_mean=1.0,
        ttft_p50_ms=100.0,
        ttft_p99_ms=p99,
        agreement=None,
        follow_ups=0,
        calls=10,
        errors=0,
        first_error="",
        cold_cached=0,
        seconds=1.0,
        kv_tokens=[],
    )


def test_report_grades_issue_31s_goals(tmp_path: Path) -> None:
    results = [
        _row(IDEAL, "chat", 0.89, None, 1.0),
        _row(AFFINITY, "chat", 0.87, 756.0, 1.10),
        _row(CACHE_AWARE, "chat", 0.83, 600.0, 1.55),
        _row(ROUND_ROBIN, "chat", 0.79, 700.0, 1.02),
        _row(IDEAL, "images", 0.81, None, 1.0),
        _row(AFFINITY, "images", 0.80, 650.0, 1.20),
        _row(LEAST_LOADED, "images", 0.65, 667.0, 1.0),
        _row(IDEAL, EVICTION, 0.89, None, 1.0),
        _row(AFFINITY, EVICTION, 0.70, 900.0, 1.30),
        _row(HOT1, EVICTION, 0.86, 500.0, 1.50),
        _row(STORE, "chat", 0.88, 590.0, 1.12),
        _row(STORE, EVICTION, 0.87, 550.0, 1.20),
    ]
    report = Report.create("routing --real-vllm", tmp_path)
    write_real_report(report, results)
    goals = {g.name: g for g in report.goals}
    tail = goals["chat: affinity TTFT p99 vs the best peer's"]
    assert (tail.met, tail.target, tail.detail) == (False, f"<= {CACHE_AWARE}'s", "by 156 ms")
    assert goals["images: affinity TTFT p99 vs the best peer's"].met is True
    assert goals["chat: affinity max/mean uncached tokens per engine"].met is True
    balance = goals[f"{EVICTION}: affinity max/mean uncached tokens per engine"]
    assert (balance.met, balance.detail) == (False, "by 0.05")
    evict = goals[f"{EVICTION}: affinity without a knob"]
    # 0.70 / 0.89 = 0.79 of the ideal's: short by 0.11; max/mean over by 0.05.
    assert evict.met is False and evict.measured.startswith("0.79 of ideal's")
    assert evict.detail == "hit rate short by 0.11 of ideal's; max/mean over by 0.05"
    # With the shared store, graded on its own rows: met where its figures are.
    assert goals[f"chat: {STORE} TTFT p99 vs the best peer's"].met is True
    assert goals[f"{EVICTION}: {STORE} without a knob"].met is True
    assert f"images: {STORE} TTFT p99 vs the best peer's" not in goals
    # The hand-set knob is reported, never graded.
    assert not any(HOT1 in g.name for g in report.goals)
    summary = report.tables[0]
    # The ideal first, then the front ends that ran, in the order of the per-workload tables.
    fronts = [AFFINITY, STORE, ROUND_ROBIN, LEAST_LOADED, HOT1, CACHE_AWARE]
    assert summary.columns == ["workload", IDEAL, *fronts]
    hot1 = summary.columns.index(HOT1)
    assert summary.rows[2][:4] == [EVICTION, "0.890", "0.700", "0.870"]
    assert summary.rows[2][hot1] == "0.860"
    report.write()
    assert (tmp_path / "routing_real_ttft.png").is_file()


def test_repeated_runs_rotate_the_fronts_and_pool_into_one_row_each(tmp_path: Path) -> None:
    fronts = [AFFINITY, STORE, CACHE_AWARE]
    orders = [front_order(fronts, r) for r in range(4)]
    assert orders[:3] == [fronts, [STORE, CACHE_AWARE, AFFINITY], [CACHE_AWARE, AFFINITY, STORE]]
    assert orders[3] == fronts and front_order([], 2) == []
    # Two runs of affinity, 100 calls each: a run's p99 is its second slowest call, the
    # pool's (200 calls) its third slowest.
    first = _row(AFFINITY, "chat", 0.9, 900.0, 1.10)
    first.ttfts = [0.1] * 98 + [0.9, 1.0]
    first.uncached_per_engine, first.requests_per_engine = [10.0, 20.0], [5.0, 6.0]
    first.follow_ups, first.agreement, first.nothing_cached = 10, 1.0, 3
    first.slowest = [SlowCall(900.0, "conversation 0", 0, 0, 0, 1)]
    second = _row(AFFINITY, "chat", 0.7, 300.0, 1.30)
    second.ttfts = [0.2] * 98 + [0.3, 1.2]
    second.uncached_per_engine, second.requests_per_engine = [30.0, 40.0], [7.0, 8.0]
    second.follow_ups, second.agreement, second.nothing_cached = 30, 0.5, 4
    second.slowest = [SlowCall(1200.0, "conversation 3", 5, 0, 0, 0, run=1)]
    peer = _row(CACHE_AWARE, "chat", 0.8, 850.0, 1.5)
    rows = pool([first, peer, second])
    assert [r.front for r in rows] == [AFFINITY, CACHE_AWARE]
    both, alone = rows
    assert alone is peer and alone.runs == 1 and alone.run_p99_ms == [850.0]
    assert (both.runs, both.calls, both.run_p99_ms) == (2, 20, [900.0, 300.0])
    assert both.ttft_p99_ms == 900.0 and both.ttft_p50_ms == 200.0
    assert both.hit_rate == pytest.approx(0.8) and both.queries == 2000.0
    # Balance is the worst run's; per-engine work and whole prefills add up.
    assert both.uncached_max_over_mean == 1.30 and both.uncached_per_engine == [40.0, 60.0]
    assert both.requests_per_engine == [12.0, 14.0] and both.nothing_cached == 7
    assert both.agreement == pytest.approx((10 * 1.0 + 30 * 0.5) / 40)
    # A run whose engines' logs could not tell where its calls went counts for nothing.
    blind = _row(AFFINITY, "chat", 0.9, 900.0, 1.10)
    blind.follow_ups, blind.agreement = 50, None
    blind.uncached_per_engine, blind.requests_per_engine = [1.0, 1.0], [1.0, 1.0]
    assert pool([first, blind])[0].agreement == 1.0
    assert [(c.ttft_ms, c.run) for c in both.slowest] == [(1200.0, 1), (900.0, 0)]
    # Graded on the pooled p99 (900 ms), not on the runs' p99s (the second run's 300 ms
    # alone, or their mean of 600, would pass against cache_aware's 850).
    report = Report.create("routing --real-vllm", tmp_path)
    write_real_report(report, rows)
    goal = next(g for g in report.goals if g.name == "chat: affinity TTFT p99 vs the best peer's")
    assert (goal.met, goal.detail) == (False, "by 50 ms")
    assert goal.measured == "900 vs 850 ms, each over 2 runs' calls"
    chat = next(t for t in report.tables if t.title == "chat")
    assert chat.rows[0][chat.columns.index("TTFT p99 of each run, ms")] == "900 / 300"
    assert chat.rows[1][chat.columns.index("TTFT p99 of each run, ms")] == ""
    opts, _ = parse_args(["--real-vllm", "--repeats", "3"])
    assert opts.repeats == 3 and parse_args(["--real-vllm"])[0].repeats == 1
    with pytest.raises(SystemExit):
        parse_args(["--real-vllm", "--repeats", "0"])


def _runs(front: str, slowest: list[float]) -> list[RealResult]:
    """One row per run of 100 calls: 98 at 100 ms and two at the run's slowest (its p99)."""
    rows = []
    for seconds in slowest:
        row = _row(front, "chat", 0.9, seconds * 1000, 1.1)
        row.ttfts = [0.1] * 98 + [seconds, seconds]
        rows.append(row)
    return rows


def test_the_tail_goal_says_how_far_its_gap_moves_with_the_runs(tmp_path: Path) -> None:
    """Pooled p99s of three runs each differ by a few calls: the goal's line gives the
    range of the gap when the runs are drawn again, so a gap within the runs' own spread
    reads as such (on the 2-core VM one front end's runs moved by up to 197 ms)."""
    slow = pool([*_runs(AFFINITY, [0.5, 0.6, 0.7]), *_runs(CACHE_AWARE, [0.2, 0.25, 0.3])])
    ours, theirs = slow
    assert [len(r) for r in run_ttfts(ours)] == [100, 100, 100]
    assert run_ttfts(ours)[2][-1] == 0.7
    spread = p99_gap_interval(ours, theirs)
    assert spread is not None
    # Whatever runs are drawn, ours is 200 to 500 ms slower.
    assert 200 <= spread[0] <= spread[1] <= 500
    # The same runs on both sides: the gap goes either way.
    alike = pool([*_runs(AFFINITY, [0.3, 0.5, 0.7]), *_runs(CACHE_AWARE, [0.3, 0.5, 0.7])])
    low, high = p99_gap_interval(*alike) or (0.0, 0.0)
    assert low < 0 < high
    # One run on a side: nothing to draw from.
    assert p99_gap_interval(ours, pool(_runs(CACHE_AWARE, [0.2]))[0]) is None
    report = Report.create("routing --real-vllm", tmp_path)
    write_real_report(report, slow)
    goal = next(g for g in report.goals if g.name == "chat: affinity TTFT p99 vs the best peer's")
    assert goal.measured == (
        f"600 vs 250 ms, each over 3 runs' calls; the gap in 90% of redraws of the runs:"
        f" {spread[0]:+,.0f} to {spread[1]:+,.0f} ms"
    )
    assert (goal.met, goal.detail) == (False, "by 350 ms, beyond the runs' spread")
    # Runs that overlap: a verdict either way says the runs cannot tell it from its
    # opposite.
    for mine, theirs_ in (([0.3, 0.5, 0.7], [0.3, 0.45, 0.7]), ([0.3, 0.45, 0.7], [0.3, 0.5, 0.7])):
        report = Report.create("routing --real-vllm", tmp_path)
        write_real_report(report, pool([*_runs(AFFINITY, mine), *_runs(CACHE_AWARE, theirs_)]))
        goal = next(g for g in report.goals if g.name.startswith("chat: affinity TTFT p99"))
        assert goal.detail.endswith("inside the runs' spread")
        assert goal.met is (mine < theirs_)
        assert goal.verdict.startswith("met (inside" if goal.met else "missed (by ")


def test_eviction_goal_is_met_at_the_bounds(tmp_path: Path) -> None:
    report = Report.create("routing --real-vllm", tmp_path)
    write_real_report(
        report, [_row(IDEAL, EVICTION, 0.90, None, 1.0), _row(AFFINITY, EVICTION, 0.81, 1.0, 1.25)]
    )
    goal = next(g for g in report.goals if g.name.endswith("without a knob"))
    assert goal.met is True and goal.detail == ""


def test_slowest_calls_name_the_call_its_turn_its_engine_and_who_shared_it(
    tmp_path: Path,
) -> None:
    calls = [("r1", "conversation 0"), ("r2", "conversation 1"), ("r3", "conversation 0"),
             ("r4", None), ("r5", "conversation 0")]  # fmt: skip
    ttft = {"r1": 0.9, "r2": 0.1, "r3": 0.5, "r5": 0.05}  # r4 failed: no first chunk
    where = {"r1": 2, "r2": 2, "r3": 0, "r5": 2}
    # r2 runs on r1's engine before r1's first chunk; r5 starts the moment r1 ends; r3
    # has its engine to itself; r4 has no span (it failed) and is never counted.
    spans = {"r1": (0.0, 1.0), "r2": (0.5, 0.7), "r3": (1.0, 1.6), "r5": (1.0, 1.1)}
    sent = sent_calls(calls, ttft, {"r1": 0, "r3": 1024}, where, spans)
    slow = slowest_calls(sent, count=3)
    assert [
        (c.ttft_ms, c.key, c.index, c.turn, c.cached, c.engine, c.alongside, c.beside) for c in slow
    ] == [
        # r1 was sent to an idle engine and r2 joined it; r2 was sent while r1 ran there.
        (900.0, "conversation 0", 0, 0, 0, 2, 1, 0),
        (500.0, "conversation 0", 2, 1, 1024, 0, 0, 0),
        (100.0, "conversation 1", 1, 0, None, 2, 1, 1),
    ]
    # Without spans (or the engine), who shared it is not known.
    assert slowest_calls(sent_calls(calls, ttft, {}, {"r1": 2}), count=1)[0].alongside is None
    result = _row(AFFINITY, "chat", 0.87, 900.0, 1.1)
    result.slowest = slow
    result.nothing_cached = nothing_cached({"r1": 0, "r3": 1024, "r5": 0})
    assert nothing_cached({}) is None
    # Every call, in the order sent, is kept for the raw results.
    assert sent == [
        ("conversation 0", 2, 0, 900.0, 1, 0),
        ("conversation 1", 2, None, 100.0, 1, 1),
        ("conversation 0", 0, 1024, 500.0, 0, 0),
        (None, None, None, None, None, None),
        ("conversation 0", 2, None, 50.0, 0, 0),
    ]
    report = Report.create("routing --real-vllm", tmp_path)
    write_real_report(report, [result])
    table = next(t for t in report.tables if t.title == "chat: the slowest calls")
    assert table.rows[0] == [AFFINITY, "900", "conversation 0", "0", "0", "0", "2", "1", "0", "1"]
    chat = next(t for t in report.tables if t.title == "chat")
    assert chat.rows[0][chat.columns.index("calls with nothing cached")] == "2"


def test_offline_prompts_find_leading_blocks_and_drop_the_least_recent() -> None:
    vocabulary: dict[str, int] = {}

    def prompt(words: list[str]) -> tuple[list[bytes], int]:
        # A role token, then the words: one token each.
        return prompt_blocks([{"role": "user", "content": " ".join(words)}], vocabulary)

    words = [f"w{i}" for i in range(299)]
    first = prompt(words)  # 300 tokens: two full blocks and a part
    second = prompt(words[:127] + [f"x{i}" for i in range(200)])
    assert first[1] == 300 and len(first[0]) == 2
    cache = PrefixCache(2 * BLOCK, BLOCK)
    assert cache.lookup(*first) == 0
    assert cache.lookup(*first) == 256  # the full blocks; the part is computed again
    assert cache.lookup(*second) == 128  # the first block is shared; its second is new
    # Capacity two blocks: the second prompt's new block pushed out `first`'s second
    # (the least recently used), not the shared first one.
    assert cache.lookup(*first) == 128
    assert prompt(words[:127])[0] == first[0][:1] and prompt(words[:126])[0] == []
    whole = PrefixCache(10 * BLOCK, BLOCK)
    whole.lookup(*prompt(words[:255]))
    # Never the prompt's last token: of 256 tokens held, one block is found.
    assert whole.lookup(*prompt(words[:255])) == 128


def test_offline_replay_rows(tmp_path: Path) -> None:
    rows = run_offline(QUICK, 0, 3, 6144, 2, tmp_path, ["few_shot", EVICTION])
    by = {(r.workload, r.front, r.replicas): r for r in rows}
    fronts = ["affinity"] + ([STORE] if redis_server_path() else [])
    for w in ("few_shot", EVICTION):
        ideal = by[(w, "ideal", 1)]
        assert len(ideal.draws) == 1 and ideal.mean("follow_ups") == 1.0
        for front in fronts:
            for replicas in (1, 2, 4):
                row = by[(w, front, replicas)]
                assert len(row.draws) == 2
                for d in row.draws:
                    assert 0.0 < d.hit_rate <= ideal.draws[0].hit_rate + 0.05
                    assert d.uncached_max_over_mean >= 1.0
                    # Every prompt's first call finds nothing cached, on any engine.
                    assert d.cold >= ideal.draws[0].cold >= 1
    report = Report.create("routing --real-vllm --offline", tmp_path / "report")
    write_offline_report(report, rows, 2)
    assert [t.title for t in report.tables] == [
        "few_shot (offline, 2 URL draws)",
        f"{EVICTION} (offline, 2 URL draws)",
    ]
    assert report.tables[0].columns[-1] == "calls with nothing cached"
    assert report.tables[0].rows[0][-1] == f"{by[('few_shot', 'ideal', 1)].draws[0].cold:.1f}"
