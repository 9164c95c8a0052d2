"""The overhead suite's goals against vllm-router (bench/overhead.py), from figures."""

from __future__ import annotations

from pathlib import Path

from bench.overhead import goals
from bench.report import Report


def run(tmp_path: Path, router: bool) -> dict[str, tuple[bool | None, str]]:
    report = Report.create("overhead", tmp_path)
    small = {"gateway": {"added_us": {"p50": 150.0}}}
    stream = {"gateway": {"added_first_chunk_us": 400.0}}
    tput = {64: {"gateway": {"rps_median": 6000.0, "cpu_us_per_request_median": 120.0}}}
    if router:
        small["vllm-router"] = {"added_us": {"p50": 160.0}}
        stream["vllm-router"] = {"added_first_chunk_us": 350.0}
        tput[64]["vllm-router"] = {"rps_median": 7000.0, "cpu_us_per_request_median": 120.0}
    goals(report, small, stream, tput)
    return {g.name: (g.met, g.detail) for g in report.goals}


def test_each_per_request_goal_against_vllm_router(tmp_path: Path) -> None:
    found = run(tmp_path, router=True)
    assert found["added latency p50 no more than vllm-router's"] == (True, "")
    # Equal is met: "no more than".
    assert found["CPU per small request at 64 connections no more than vllm-router's"] == (
        True,
        "",
    )
    assert found["streaming first chunk added no more than vllm-router's"] == (False, "by 50 us")


def test_without_vllm_router_the_goals_are_not_checked(tmp_path: Path) -> None:
    found = run(tmp_path, router=False)
    for name in (
        "added latency p50 no more than vllm-router's",
        "CPU per small request at 64 connections no more than vllm-router's",
        "streaming first chunk added no more than vllm-router's",
    ):
        assert found[name] == (None, "vllm-router not measured")
