"""The overhead suite's goals against vllm-router (bench/suites/overhead.py), from figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.suites.overhead import against_baseline, goals, image_against_baseline, image_goals
from bench.suites.report import Report


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


def test_baseline_tree_is_checked(tmp_path: Path) -> None:
    from bench.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["scale", "--baseline-tree", str(tmp_path)])
    with pytest.raises(SystemExit):
        parse_args(["overhead", "--baseline-tree", str(tmp_path)])  # no gateway package
    (tmp_path / "gateway").mkdir()
    assert parse_args(["overhead", "--baseline-tree", str(tmp_path)]).baseline_tree == tmp_path


def test_against_baseline_table(tmp_path: Path) -> None:
    report = Report.create("overhead", tmp_path)
    small = {
        t: {"added_us": {"p50": v}} for t, v in (("gateway", 150.0), ("gateway-baseline", 200.0))
    }
    stream = {"gateway": {"added_first_chunk_us": 300.0}}
    tput = {64: {"gateway": {"cpu_us_per_request_median": 90.0}}}
    tput[64]["gateway-baseline"] = {"cpu_us_per_request_median": 100.0}
    against_baseline(report, small, stream, tput)
    rows = {r[0]: r for r in report.raw["against_baseline"]}
    assert rows["added p50 at 1 connection, us"][1:4] == [200.0, 150.0, 0.75]
    assert rows["streaming first chunk added, us"][3] is None
    assert rows["CPU per request at 64 connections, us"][3] == 0.9
    # Without a baseline: no table.
    empty = Report.create("overhead", tmp_path / "other")
    against_baseline(empty, {"gateway": small["gateway"]}, stream, tput)
    assert empty.tables == []


def test_image_against_baseline_table(tmp_path: Path) -> None:
    report = Report.create("overhead", tmp_path)
    figures = {
        "cases": {
            "header": {"gateway_added_us": 900.0, "baseline_added_us": 1000.0},
            "decode": {"gateway_added_us": 12000.0, "baseline_added_us": 0.0},
        }
    }
    image_against_baseline(report, figures)
    rows = {r[0]: r for r in report.raw["images_against_baseline"]}
    assert rows["header"][1:] == [1000.0, 900.0, 0.9]
    assert rows["decode"][3] is None
    # Without a baseline: no table.
    empty = Report.create("overhead", tmp_path / "other")
    image_against_baseline(empty, {"cases": {"header": {"gateway_added_us": 900.0}}})
    assert empty.tables == []


def test_image_goals_read_the_sum_and_the_decoding_floor(tmp_path: Path) -> None:
    report = Report.create("overhead", tmp_path)
    figures = {
        "pillow_decode_us": 7000.0,
        "floor_decode_added_us": 10500.0,
        "cases": {
            "decode": {"floor_added_us": 3000.0, "gateway_added_us": 10400.0},
            "decode-cached": {"floor_added_us": 4000.0, "gateway_added_us": 6100.0},
        },
    }
    image_goals(report, figures)
    found = {g.name: (g.met, g.detail) for g in report.goals}
    assert found["1 MB image, verdict cached: added p50 within 1.5x of the floor"] == (
        False,
        "by 100 us",
    )
    assert found["1 MB image, default depth: added p50 <= floor + Pillow's decode alone"] == (
        False,
        "by 400 us",
    )
    assert found["1 MB image, default depth: added p50 <= the floor that decodes, same blocks"] == (
        True,
        "",
    )
    # No decoding floor measured: that goal says so, the others stand.
    other = Report.create("overhead", tmp_path / "other")
    image_goals(other, {**figures, "floor_decode_added_us": None})
    found = {g.name: (g.met, g.measured) for g in other.goals}
    assert found["1 MB image, default depth: added p50 <= the floor that decodes, same blocks"] == (
        None,
        "not measured",
    )
