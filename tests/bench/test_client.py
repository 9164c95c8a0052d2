"""The client suite (bench/suites/client.py) without an engine: vLLM's result file read,
the key handed to vLLM's client as it reads it, the per-round ratios and the goals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.suites.bench_serve import TEXT, BenchServe, Outcome, images, load_result
from bench.suites.client import Comparison, grade, spread_text
from bench.suites.report import NOT_GRADED, Report

DATA = Path(__file__).parent / "data"


def test_a_result_file_of_vllm_bench_serve_is_read() -> None:
    # Written by vLLM 0.32.0's `vllm bench serve --save-result --save-detailed`: random-mm,
    # one new 448-pixel image a request, through the gateway.
    outcome = load_result(DATA / "vllm_bench_serve_images.json")
    assert outcome.ttft_p50_ms == pytest.approx(134.83, abs=0.005)
    assert outcome.ttft_p99_ms == pytest.approx(217.40, abs=0.005)
    assert outcome.tpot_p50_ms == pytest.approx(4.139, abs=0.0005)
    assert outcome.throughput == pytest.approx(238.8, abs=0.05)
    assert (outcome.completed, outcome.failed, outcome.errors) == (4, 0, ())


def test_a_refused_run_keeps_its_distinct_errors() -> None:
    # The same client with a key the gateway does not know: every request answered 401.
    outcome = load_result(DATA / "vllm_bench_serve_refused.json")
    assert (outcome.completed, outcome.failed) == (0, 4)
    assert outcome.errors == ("Unauthorized",)
    assert outcome.ttft_p50_ms == 0.0


def client(tmp_path: Path) -> BenchServe:
    return BenchServe(Path("/venv/bin/python"), "tiny-qwen2vl", "tok", tmp_path, 48, 4)


def test_the_key_goes_where_vllms_client_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `_get_headers` in vllm/benchmarks/lib/endpoint_request_func.py: $OPENAI_API_KEY as Bearer.
    monkeypatch.setenv("OPENAI_API_KEY", "the-callers-own")
    monkeypatch.setenv("https_proxy", "http://proxy.invalid:3128")
    env = client(tmp_path).environment("client-key")
    assert env["OPENAI_API_KEY"] == "client-key"
    assert "https_proxy" not in env
    assert env["HF_HUB_OFFLINE"] == "1"
    # Direct to an engine without --api-key: no key at all, not the caller's.
    assert "OPENAI_API_KEY" not in client(tmp_path).environment(None)
    command = client(tmp_path).command("http://127.0.0.1:8000/", TEXT, 7, tmp_path / "r.json")
    assert "client-key" not in " ".join(command)


def test_each_run_names_its_seed_model_and_images(tmp_path: Path) -> None:
    command = client(tmp_path).command(
        "http://127.0.0.1:8000/", images(896), 7, tmp_path / "r.json"
    )
    joined = " ".join(command)
    assert "--base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions" in joined
    assert "--model tiny-qwen2vl --tokenizer tok" in joined
    assert "--seed 7" in joined
    assert "--dataset-name random-mm" in joined
    assert command[command.index("--random-mm-bucket-config") + 1] == "{(896, 896, 1): 1.0}"
    assert "--metric-percentiles 50,99" in joined


def outcome(ttft: float, throughput: float, failed: int = 0) -> Outcome:
    return Outcome(ttft, ttft * 2, 4.0, 6.0, throughput, 20.0, 48 - failed, failed, 2.0)


def comparison(
    name: str, direct: list[tuple[float, float]], gateway: list[tuple[float, float]]
) -> Comparison:
    workload = TEXT if name == "text" else images(int(name.split()[1]))
    return Comparison(
        workload,
        [outcome(t, r) for t, r in direct],
        [outcome(t, r) for t, r in gateway],
    )


def test_ratios_are_per_round_with_their_range() -> None:
    c = comparison("text", [(40, 700), (50, 600), (40, 800)], [(44, 630), (50, 600), (48, 720)])
    ttft = c.ratio("ttft_p50_ms")
    assert ttft == pytest.approx({"median": 1.1, "min": 1.0, "max": 1.2})
    assert spread_text(ttft) == "1.10x (1.00-1.20)"
    assert c.ratio("throughput") == pytest.approx({"median": 0.9, "min": 0.9, "max": 1.0})
    assert spread_text({}) == "n/a"


def goals(
    tmp_path: Path, comparisons: list[Comparison], smoke: bool = False
) -> dict[str, tuple[bool | None, str]]:
    report = Report.create("client", tmp_path, smoke=smoke)
    grade(report, comparisons)
    return {g.name: (g.met, g.verdict) for g in report.goals}


def test_the_goals_text_within_1_1_images_within_1_25_throughput_at_least_0_9(
    tmp_path: Path,
) -> None:
    found = goals(
        tmp_path,
        [
            # Text at exactly 1.1x is met ("within").
            comparison("text", [(40, 700)], [(44, 700)]),
            # Images: 1.2x met, 1.3x missed; throughput 0.85x missed.
            comparison("image 448", [(50, 600)], [(60, 600)]),
            comparison("image 896", [(100, 400)], [(130, 340)]),
        ],
    )
    assert found["text: TTFT p50 through the gateway"] == (True, "met")
    assert found["text: throughput through the gateway"] == (True, "met")
    assert found["image 448: TTFT p50 through the gateway"] == (True, "met")
    assert found["image 896: TTFT p50 through the gateway"] == (False, "missed (by 0.05x)")
    assert found["image 896: throughput through the gateway"] == (False, "missed (by 0.05x)")
    assert found["every request through the gateway answered"] == (True, "met")


def test_a_failed_request_through_the_gateway_misses_and_no_run_is_not_checked(
    tmp_path: Path,
) -> None:
    failing = comparison("text", [(40, 700)], [(40, 700)])
    failing.gateway[0] = dataclasses.replace(failing.gateway[0], failed=1)
    found = goals(tmp_path, [failing])
    assert found["every request through the gateway answered"][0] is False
    # A round where every request through the gateway failed has TTFT 0 in vLLM's file:
    # it is left out of the ratios, not read as free.
    refused = comparison("text", [(40, 700)], [(40, 700)])
    refused.gateway[0] = load_result(DATA / "vllm_bench_serve_refused.json")
    found = goals(tmp_path, [refused])
    assert found["text: TTFT p50 through the gateway"] == (None, "not checked")
    assert found["every request through the gateway answered"][0] is False
    empty = goals(tmp_path, [comparison("text", [], [])])
    assert empty["text: TTFT p50 through the gateway"] == (None, "not checked")
    assert empty["every request through the gateway answered"] == (None, "not checked")


def test_a_smoke_run_grades_nothing(tmp_path: Path) -> None:
    found = goals(tmp_path, [comparison("text", [(40, 700)], [(80, 300)])], smoke=True)
    assert {verdict for _, verdict in found.values()} == {NOT_GRADED}
