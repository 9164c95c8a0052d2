"""The routing bench's workload machinery and its in-process replay (bench/suites/routing/,
bench/suites/routing/workloads.py). The live run through real engines is in test_bench.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.suites.routing import Options, offline
from bench.suites.routing.inprocess import balls_into_bins
from bench.suites.routing.workloads import CHAT, Call, Workload, build, follow, interleave


def _call(tag: str, follow_up: bool = False) -> Call:
    return Call(CHAT, {"messages": [{"role": "user", "content": tag}]}, follow_up)


def test_interleave_keeps_live_sessions_open_and_turns_in_order() -> None:
    sessions = [[_call(f"{s}{t}") for t in range(n)] for s, n in enumerate([3, 1, 2])]
    order = [(i, c.body["messages"][0]["content"]) for i, c in interleave(sessions, 2)]
    # Two sessions open; an answered one waits at the back; a finished one makes room
    # for the next, which joins at the back.
    assert order == [(0, "00"), (1, "10"), (0, "01"), (0, "02"), (2, "20"), (2, "21")]
    assert len(interleave(sessions, 1)) == 6
    assert [i for i, _ in interleave(sessions, 1)] == [0, 0, 0, 1, 2, 2]


def test_follow_up_sends_the_conversation_and_the_engines_reply_back() -> None:
    first = Call(CHAT, {"model": "m", "messages": [{"role": "system", "content": "s"}]})
    second = _call("next?", follow_up=True)
    assert follow(first, None, "") is first.body
    body = follow(second, first.body, "the reply")
    assert body["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "the reply"},
        {"role": "user", "content": "next?"},
    ]
    assert second.body["messages"] == [{"role": "user", "content": "next?"}]  # not mutated
    assert follow(_call("alone"), first.body, "x") == _call("alone").body


def test_chat_workload_turns_follow_up_and_ask_for_exact_reply_lengths() -> None:
    (chat,) = build(["chat"], "m", scale=0.1)
    assert chat.warmup > 0 and len(chat.measured) == len(chat.sessions) - chat.warmup
    for session in chat.sessions:
        assert not session[0].follow_up and all(c.follow_up for c in session[1:])
        assert session[0].body["messages"][0]["role"] == "system"
        for call in session:
            assert call.body["ignore_eos"] is True and 100 <= call.body["max_tokens"] <= 200


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chat", "images", "templates"])
def test_offline_affinity_halves_round_robins_uncached_tokens(name: str) -> None:
    """In-process, with the engines' caches modelled by the simulator's own code: where
    prefixes belong to conversations, images or templates, affinity computes at most
    half of what round robin computes, and never less than the ideal engine."""
    (workload,) = build([name], "Qwen/Qwen3-VL-2B-Instruct")
    results = {r.policy: r for r in offline(workload, {}, 2, Options())}
    ideal, rr, affinity = (results[p] for p in ("ideal", "round_robin", "affinity"))
    assert ideal.uncached <= affinity.uncached <= 0.5 * rr.uncached
    assert affinity.hit_rate >= 0.9 * ideal.hit_rate
    # Two gateways taking alternate requests, no shared state: still far from round robin.
    assert results["affinity, 2 replicas"].uncached <= 0.75 * rr.uncached


@pytest.mark.slow
def test_offline_one_shared_prefix_is_the_case_no_router_can_halve() -> None:
    """Few-shot: everyone shares one prefix. Round robin computes it once per engine and
    then always hits; affinity spreads it the same way (the hot rule), so the ideal
    engine's floor is above half of round robin, and affinity is near round robin."""
    (workload,) = build(["few_shot"], "m", scale=0.5)
    results = {r.policy: r for r in offline(workload, {}, 2, Options())}
    assert results["ideal"].uncached > 0.5 * results["round_robin"].uncached
    assert results["affinity"].uncached > 0.9 * results["round_robin"].uncached
    assert results["affinity"].worst_spread <= 1.5


def test_offline_counts_nothing_of_the_warm_up() -> None:
    (chat,) = build(["chat"], "m", scale=0.25)
    cold = Workload(chat.name, chat.description, chat.measured, 0)
    warm = {r.policy: r for r in offline(chat, {}, 1, Options())}
    alone = {r.policy: r for r in offline(cold, {}, 1, Options())}
    # Same measured requests; after a warm-up the shared system prompt is already cached.
    assert warm["ideal"].uncached < alone["ideal"].uncached


def test_offline_replicas_taking_turns_keep_one_gateways_hits() -> None:
    """Two and four gateways taking the chat requests in turn route every follow-up turn
    to its conversation's engine, as one gateway does (the previous design, placing
    conversations by each process's own history: 93.2% and 86.1%)."""
    (workload,) = build(["chat"], "Qwen/Qwen3-VL-2B-Instruct", scale=0.5)
    results = {r.policy: r for r in offline(workload, {}, 2, Options())}
    one = results["affinity"]
    assert one.agreement == 1.0
    for name in ("affinity, 2 replicas", "affinity, 4 replicas"):
        assert results[name].agreement == 1.0
        assert results[name].hit_rate >= one.hit_rate - 0.01
    assert results["round_robin"].agreement is not None
    assert results["round_robin"].agreement < 0.5


def test_offline_replicas_keep_every_image_question_on_the_images_engine() -> None:
    """Images under a shared system prompt: four fresh replicas taking the questions in
    turn send every question, warm-up included, to its image's engine, and lose no hit
    rate against one gateway (anchoring each process's first requests on the prompt:
    96.8% of follow-ups and 1.4 points lost at full scale)."""
    (workload,) = build(["images"], "Qwen/Qwen3-VL-2B-Instruct", scale=0.5)
    results = {r.policy: r for r in offline(workload, {}, 2, Options())}
    one = results["affinity"]
    for name in ("affinity", "affinity, 2 replicas", "affinity, 4 replicas"):
        assert results[name].agreement == 1.0, name
        assert results[name].worst_agreement == 1.0, name
        assert results[name].hit_rate >= one.hit_rate - 0.001, name


def test_balls_into_bins_is_the_spread_of_random_placement() -> None:
    """One group fills one engine of four (max / mean 4); many equal groups come near 1."""
    assert balls_into_bins([10], 4, trials=50) == (4.0, 1.0)
    spread, over = balls_into_bins([1] * 4000, 4, trials=200)
    assert spread < 1.05 and over == 0.0


def test_the_store_rows_run_only_when_asked_for() -> None:
    from bench.suites.routing.fronts import STORE, fronts

    names = [f.name for f in fronts(Options(store=False))]
    assert not any(STORE in n for n in names)
    if shutil.which("redis-server") is None:
        with pytest.raises(SystemExit, match="redis-server"):
            fronts(Options(store=True))
        return
    store = [f for f in fronts(Options(store=True)) if f.family == STORE]
    assert [(f.name, f.replicas) for f in store] == [
        (STORE, 1),
        (f"{STORE}, 2 replicas", 2),
        (f"{STORE}, 4 replicas", 4),
    ]


def test_merged_rows_fill_in_the_front_ends_not_run_again(tmp_path: Path) -> None:
    from bench.suites.routing.live import Result, merged_rows

    def row(front: str, workload: str) -> Result:
        return Result(front, workload, 0.5, 10.0, 1.0, 2.0, 1.1, 1.1, [1, 2], 0, 1.0)

    earlier = [row("affinity", "chat"), row("round_robin", "chat"), row("round_robin", "images")]
    raw = {"raw": {"results": [r.__dict__ for r in earlier]}}
    (tmp_path / "results.json").write_text(json.dumps(raw))
    workloads = build(["chat"], "m", 0.1)
    rows = merged_rows(tmp_path, [row("affinity", "chat")], workloads)
    assert [(r.front, r.workload) for r in rows] == [("round_robin", "chat")]
