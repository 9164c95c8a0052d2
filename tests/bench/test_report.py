"""bench/suites/report.py: a smoke run (`--quick`) says so at the top of its report, in the
summary and in every plot's title, and grades no goal; a measured run grades them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.suites.report import NOT_GRADED, SMOKE, Report, cpu_model


def written(tmp_path: Path, smoke: bool) -> tuple[Report, str, dict[str, Any]]:
    report = Report.create("scale", tmp_path, smoke=smoke)
    report.goal("no errors at 64 connections", "0 errors", "0 errors", True)
    report.bound("memory stays flat", "growth <= 50%", "+80%", 0.8, 0.5, lambda d: f"{d:.0%}")
    report.table("Throughput", ["target", "req/s"], [["gateway", 2.0]])

    def draw(axes: Any) -> None:
        axes[0].set_title("Small chat throughput by concurrency", pad=14)
        axes[1].plot([1, 2], [3, 4])  # no title of its own

    report.plot("scale_throughput", draw, rows=2)
    report.write()
    data = json.loads((tmp_path / "results.json").read_text())
    return report, (tmp_path / "report.md").read_text(), data


def test_a_smoke_run_says_so_and_grades_no_goal(tmp_path: Path) -> None:
    report, md, data = written(tmp_path, smoke=True)
    title, _, first = md.splitlines()[:3]
    assert title == "# bench: scale" and first.startswith(f"**{SMOKE}.**")
    rows = [line for line in md.splitlines() if line.startswith("| ") and "%" in line]
    assert rows and all(line.endswith(f"| {NOT_GRADED} |") for line in rows)
    assert "| met" not in md and "| missed" not in md
    assert data["smoke"] is True
    assert [g["graded"] for g in data["goals"]] == [False, False]
    # What the checks said stays in the raw results, for the suites' own tests.
    assert [g["met"] for g in data["goals"]] == [True, False]
    assert data["plot_titles"] == {
        "scale_throughput.png": [f"{SMOKE}: Small chat throughput by concurrency", SMOKE]
    }
    summary = report.summary()
    assert summary.splitlines()[0] == SMOKE
    assert "MET" not in summary and "MISSED" not in summary and NOT_GRADED in summary


def test_a_measured_run_grades_its_goals(tmp_path: Path) -> None:
    report, md, data = written(tmp_path, smoke=False)
    assert SMOKE not in md and SMOKE not in report.summary()
    assert "| no errors at 64 connections | 0 errors | 0 errors | met |" in md
    assert "| memory stays flat | growth <= 50% | +80% | missed (by 30%) |" in md
    assert data["smoke"] is False and all(g["graded"] for g in data["goals"])
    titles = data["plot_titles"]["scale_throughput.png"]
    assert titles == ["Small chat throughput by concurrency", ""]


@pytest.mark.parametrize("smoke", [True, False])
def test_the_walk_report_says_when_it_is_a_smoke_run(smoke: bool) -> None:
    from bench.suites.walk import report

    row = {"shape": "chat", "bytes": 1000, "objects": 12, "repeats": 5, "parse_ms": 0.01,
           "walk_ms": 0.02, "walk_per_parse": 2.0}  # fmt: skip
    assert (SMOKE in report([row], smoke)) is smoke


def test_the_report_names_the_cpu(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n\n")
    assert cpu_model(cpuinfo) == "AMD EPYC"
    # No such file (not Linux): the platform's name for it, never an error.
    assert cpu_model(tmp_path / "absent") != ""
    _, md, data = written(tmp_path / "out", smoke=False)
    assert f"- cpu_model: {data['meta']['cpu_model']}" in md.splitlines()
    assert data["meta"]["cpu_model"] == cpu_model()
