"""The peers in the bench (issue 30): how sglang-router and LiteLLM are started, the
cache-aware row's workload, and the grading of issue 30's goals from figures."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.harness.origin import RecordingServer, Route
from bench.suites import cache_aware
from bench.suites.fleet import Target, litellm_binary, litellm_config, sglang_router_args
from bench.suites.instructions import grade, runs
from bench.suites.loadgen import Load, interleaved_latency, raw_request, run_python
from bench.suites.overhead import PEERS, peer_goal
from bench.suites.report import Report

ENGINE = "http://127.0.0.1:8101"
MODEL = "Qwen/Qwen3-VL-2B-Instruct"


def verdicts(report: Report) -> dict[str, tuple[bool | None, str]]:
    return {g.name: (g.met, g.detail) for g in report.goals}


# --- starting the peers ---------------------------------------------------------------


@pytest.mark.parametrize("engine", [ENGINE, ENGINE + "/"])
def test_litellm_serves_the_model_from_the_engine_as_an_openai_backend(engine: str) -> None:
    config = json.loads(litellm_config(engine, MODEL, "sk-test-key"))
    (entry,) = config["model_list"]
    # Clients ask for the engine's own model name; LiteLLM sends it on unchanged.
    assert entry["model_name"] == MODEL
    assert entry["litellm_params"]["model"] == f"openai/{MODEL}"
    assert entry["litellm_params"]["api_base"] == ENGINE + "/v1"
    # Without a master key the proxy refuses to start.
    assert config["general_settings"]["master_key"] == "sk-test-key"
    assert config["litellm_settings"]["telemetry"] is False


def test_litellm_is_found_by_option_then_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given, from_env = tmp_path / "given-litellm", tmp_path / "env-litellm"
    given.touch()
    from_env.touch()
    monkeypatch.setenv("BENCH_LITELLM", str(from_env))
    assert litellm_binary(given) == given
    assert litellm_binary() == from_env
    # A path that does not exist: not installed, the peer is skipped.
    assert litellm_binary(tmp_path / "missing") is None
    monkeypatch.setenv("BENCH_LITELLM", str(tmp_path / "missing"))
    assert litellm_binary() is None


def test_sglang_router_listens_on_loopback_with_its_metrics_on_the_given_port() -> None:
    engines = [ENGINE, "http://127.0.0.1:8102"]
    args = sglang_router_args(Path("/venv/bin/sglang-router"), 9000, engines, "cache_aware", 9001)
    assert args[:2] == ["/venv/bin/sglang-router", "launch"]

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert (value("--host"), value("--port"), value("--policy")) == (
        "127.0.0.1",
        "9000",
        "cache_aware",
    )
    # Its metrics listener defaults to 0.0.0.0:29000: a second router would not start.
    assert (value("--prometheus-host"), value("--prometheus-port")) == ("127.0.0.1", "9001")
    start = args.index("--worker-urls") + 1
    assert args[start : start + 2] == engines
    assert args[start + 2].startswith("--")


# --- the cache-aware row's workload -----------------------------------------------------


def test_twelve_conversations_share_one_system_prompt() -> None:
    conversations = cache_aware.conversations(MODEL)
    assert len(conversations) == 12
    assert len({c[0]["content"] for c in conversations}) == 1
    assert {c[0]["role"] for c in conversations} == {"system"}
    assert len({c[1]["content"] for c in conversations}) == 12


@pytest.mark.parametrize(("stream", "tokens"), list(cache_aware.CASES.values()))
def test_each_case_sends_every_conversation(stream: bool, tokens: int) -> None:
    bodies = [orjson.loads(b) for b in cache_aware.bodies(MODEL, stream, tokens)]
    assert [b["messages"] for b in bodies] == cache_aware.conversations(MODEL)
    assert {b["max_tokens"] for b in bodies} == {tokens}
    assert {b.get("stream", False) for b in bodies} == {stream}


# --- several bodies in turn -------------------------------------------------------------


@pytest.fixture
def origin() -> Iterator[RecordingServer]:
    with RecordingServer({"/": Route(body=b"ok")}) as server:
        yield server


def lengths(server: RecordingServer) -> list[int]:
    return [int(h.headers["Content-Length"]) for h in server.hits]


def test_one_connection_sends_the_bodies_in_turn(origin: RecordingServer) -> None:
    target = Target("origin", origin.url)
    raws = [raw_request(target, "/", b"x" * n) for n in (1, 2, 3)]
    out = interleaved_latency({"origin": (target, raws)}, samples=6, block=3, warmup=2)
    assert out["origin"]["statuses"] == {"200": 6}
    # The warm-up's two, then on from the third.
    assert lengths(origin) == [1, 2, 3, 1, 2, 3, 1, 2]


@pytest.mark.slow
def test_the_load_generator_shares_the_bodies_out_by_connection() -> None:
    with RecordingServer({"/": Route(body=b"ok", delay=0.3)}) as slow:
        result = run_python(Target("slow", slow.url), Load("/", (b"a", b"bb"), 4, 0.05))
        assert result.requests == 4 and result.errors == 0
        assert sorted(lengths(slow)) == [1, 1, 2, 2]


# --- grading ----------------------------------------------------------------------------


def test_goal_one_grades_the_gateway_against_each_router(tmp_path: Path) -> None:
    report = Report.create("overhead", tmp_path)
    gw, vllm, sglang = cache_aware.GATEWAY, *cache_aware.ROUTERS
    figures: dict[str, Any] = {
        "small chat": {
            "added p50": {gw: 300.0, vllm: 800.0, sglang: 250.0},
            "CPU per request at 64 connections": {gw: 100.0, vllm: 100.0},
        },
        "16-token stream": {"instructions per request": {gw: 500_000.0, sglang: 480_000.0}},
    }
    cache_aware.goals(report, figures)
    found = verdicts(report)
    prefix = "issue 30 goal 1, small chat, 2 engines: "
    assert found[f"{prefix}added p50, gateway (affinity) no more than {vllm}"] == (True, "")
    assert found[f"{prefix}added p50, gateway (affinity) no more than {sglang}"] == (
        False,
        "by 50 us",
    )
    # Equal is met: "no more than"; a router not measured is not graded.
    cpu = f"{prefix}CPU per request at 64 connections, gateway (affinity) no more than "
    assert found[cpu + vllm] == (True, "")
    assert found[cpu + sglang] == (None, f"{sglang} not measured")
    stream = "issue 30 goal 1, 16-token stream, 2 engines: instructions per request, "
    assert found[f"{stream}gateway (affinity) no more than {sglang}"] == (False, "by 20K")
    assert found[f"{stream}gateway (affinity) no more than {vllm}"][0] is None
    assert len(report.goals) == 6


@pytest.mark.parametrize(
    ("small", "stream", "expected"),
    [
        (360_000.0, 430_000.0, [(True, ""), (True, "")]),
        (475_000.0, 431_000.0, [(False, "by 115K"), (False, "by 1K")]),
    ],
)
def test_goal_two_grades_the_one_engine_counts(
    tmp_path: Path, small: float, stream: float, expected: list[tuple[bool, str]]
) -> None:
    report = Report.create("instructions", tmp_path)
    results = {"gateway": {"small chat": small, "16-token stream": stream}}
    grade(report, results, set())
    assert [(g.met, g.detail) for g in report.goals] == expected
    assert [g.target for g in report.goals] == ["<= 360K", "<= 430K"]


def test_instructions_grade_goal_one_on_the_two_engine_row_only(tmp_path: Path) -> None:
    report = Report.create("instructions", tmp_path)
    one = {"small chat": 400_000.0, "16-token stream": 450_000.0}
    results = {
        "gateway": one,
        # One engine: not the row, though its counts are lower.
        "vllm-router": {"small chat": 1.0, "16-token stream": 1.0},
        cache_aware.GATEWAY: {"small chat": 500_000.0, "16-token stream": 600_000.0},
        "vllm-router cache_aware": {"small chat": 550_000.0, "16-token stream": 590_000.0},
    }
    grade(report, results, {cache_aware.GATEWAY, "vllm-router cache_aware"})
    goal_one = {g.name: g.met for g in report.goals if "goal 1" in g.name}
    assert goal_one == {
        "issue 30 goal 1, small chat, 2 engines: instructions per request, gateway "
        "(affinity) no more than vllm-router cache_aware": True,
        "issue 30 goal 1, 16-token stream, 2 engines: instructions per request, gateway "
        "(affinity) no more than vllm-router cache_aware": False,
        "issue 30 goal 1, small chat, 2 engines: instructions per request, gateway "
        "(affinity) no more than sglang-router cache_aware": None,
        "issue 30 goal 1, 16-token stream, 2 engines: instructions per request, gateway "
        "(affinity) no more than sglang-router cache_aware": None,
    }


def options(*argv: str) -> argparse.Namespace:
    from bench.suites.instructions import parse_args

    return parse_args(list(argv))


def test_instructions_count_each_proxy_in_its_row() -> None:
    every = [(r.name, r.two_engines) for r in runs(options())]
    assert every == [
        ("gateway", False),
        ("vllm-router", False),
        ("sglang-router", False),
        (cache_aware.GATEWAY, True),
        ("vllm-router cache_aware", True),
        ("sglang-router cache_aware", True),
    ]
    assert [r.name for r in runs(options("--no-router"))] == ["gateway", cache_aware.GATEWAY]
    assert [r.name for r in runs(options("--no-cache-aware", "--no-gateway"))] == [
        "vllm-router",
        "sglang-router",
    ]


def test_goal_four_names_the_peers_not_measured(tmp_path: Path) -> None:
    report = Report.create("overhead", tmp_path)
    every = {name: {} for name, _, _ in PEERS}
    peer_goal(report, every, {"small": {}})
    peer_goal(report, {"nginx": {}}, {})
    (met, missed) = report.goals
    assert (met.met, met.detail) == (True, "")
    assert missed.met is False
    assert missed.detail == (
        "not installed: vllm-router, vllm-router cache_aware, sglang-router, "
        "sglang-router cache_aware, litellm"
    )
