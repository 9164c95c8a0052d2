"""The soak suite (bench/suites/soak/): its quick form run whole against a real gateway and a
simulated engine, and its pieces. It asserts that the soak measures (traffic in every
phase, every kind of abuse sent and accounted for, resources sampled throughout), not
that the gateway withstands the abuse: that is what the soak reports."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from bench.__main__ import parse_args
from bench.suites.report import NOT_GRADED, SMOKE
from bench.suites.soak.legit import Outcome
from bench.suites.soak.payloads import HeavyPng
from bench.suites.soak.suite import (
    PHASES,
    QUICK_DURATION,
    RATE,
    WINDOW,
    Timeline,
    legit_stats,
    pinned_defaults,
)
from gateway.config.settings import Settings
from gateway.errors import MediaInvalid
from gateway.media.settings import MediaSettings
from tests.procs import ROOT
from tests.unit.media.image_validation import validate_image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HELD = ("slowloris head", "idle connection", "slow body")
REQUESTS = (
    "bad JSON",
    "oversized body, declared",
    "oversized body, chunked",
    "oversized media, bytes",
    "oversized media, pixels",
    "decode-heavy media",
)
GOALS = (
    "legitimate error rate under abuse",
    "legitimate p99 under abuse",
    "RSS flat under abuse",
    "RSS peak",
    "RSS back after the abuse",
    "descriptors back after the abuse",
    "gateway alive at the end",
)


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`python -m bench soak --quick`, in its own process group: whatever happens to the
    test (a failure, its timeout), the group is killed, engines and gateway included."""
    out = tmp_path_factory.mktemp("soak") / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "soak", "--quick", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=110)
        assert proc.returncode == 0, stderr[-3000:]
        assert "report:" in stdout
        # The suite stopped everything it started: its process group is empty.
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
        data: dict[str, Any] = json.loads((out / "results.json").read_text())
        data["_out"] = out
        yield data
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.slow
@pytest.mark.timeout(130)
def test_soak_sends_legitimate_traffic_in_every_phase(soak: dict[str, Any]) -> None:
    by_phase = soak["raw"]["legit"]["by_phase"]
    shares = dict(PHASES)
    for phase in ("baseline", "abuse", "recovery"):
        # Open loop: the schedule, whatever the gateway did.
        expected = RATE * QUICK_DURATION * shares[phase]
        assert abs(by_phase[phase]["sent"] - expected) <= 2, (phase, by_phase[phase])
    base = by_phase["baseline"]
    assert base["error_rate"] <= 0.1, base
    assert 0 < base["p50_ms"] <= base["p99_ms"] < 10_000
    rows = soak["raw"]["legit_requests"]["rows"]
    assert {r[1] for r in rows} == {"chat", "stream", "completion", "image"}
    assert {r[2] for r in rows} == {"tenant-a", "tenant-b"}
    # Every request ended one way or another: a status, or an error without one.
    assert all(r[5] is not None or r[6] is not None for r in rows)
    table = next(t for t in soak["tables"] if t["title"] == "Legitimate requests by phase")
    assert [r[0] for r in table["rows"]] == ["baseline", "abuse", "recovery"]


@pytest.mark.slow
@pytest.mark.timeout(130)
def test_soak_sends_every_kind_of_abuse(soak: dict[str, Any]) -> None:
    kinds = soak["raw"]["abuse"]["kinds"]
    assert set(kinds) == {*HELD, *REQUESTS}
    for name, tally in kinds.items():
        outcomes = tally["outcomes"]
        assert tally["sent"] > 0, name
        # Each connection or request is accounted for exactly once.
        assert sum(outcomes.values()) - outcomes.get("connect failed", 0) == tally["sent"], name
    ends = {"closed by gateway", "no answer in time", "unfinished at end", "connect failed"}
    answered = 0
    for name in REQUESTS:
        outcomes = kinds[name]["outcomes"]
        # An HTTP status read from the gateway, or how the request ended without one (a
        # stalled gateway leaves some unanswered in the quick form's 10 s: reported).
        assert all(k.startswith("status ") or k in ends for k in outcomes), (name, outcomes)
        answered += sum(n for k, n in outcomes.items() if k.startswith("status 4"))
    # Refusals read from the gateway (4xx), even from a gateway stalled by the abuse.
    assert answered >= 3, kinds
    defaults = soak["meta"]["gateway_defaults"]
    assert kinds["slow body"]["sent"] >= defaults["max_in_flight"]
    assert kinds["slowloris head"]["sent"] >= 200 and kinds["idle connection"]["sent"] >= 100
    res = soak["raw"]["resources"]
    # The held connections reached the gateway's process.
    assert res["fds_abuse_max"] > res["fds_baseline_max"]
    assert soak["raw"]["abuse"]["errors"] == []


# What the quick form can show of the defences on a loaded 2-core machine: latency
# ratios and the 10 s head deadline need the longer runs (bench/README.md, "Soak"). The
# report's own bounds on errors and descriptors (1 point, 8) are its goals, measured on an
# idle machine; this test holds the gateway to bounds that a loaded machine keeps and a
# gateway without the defences misses by far: its legitimate requests failed 92-95%
# under the abuse, and the 300 held connections stayed open after it.
HOLDS = ("RSS peak", "gateway alive at the end")
ERROR_RISE_MAX = 0.25  # abuse-phase legitimate error rate over the baseline's
FDS_RETAINED_MAX = 50  # descriptors at rest after the run over those before it


@pytest.mark.slow
@pytest.mark.timeout(130)
def test_the_gateway_holds_under_the_quick_soak(soak: dict[str, Any]) -> None:
    """Legitimate requests do not fail under abuse (slow bodies once held every slot:
    94.7% of them failed), the RSS stays under 512 MiB (it reached 3.6 GiB), the held
    connections are closed, the gateway survives."""
    by_phase = soak["raw"]["legit"]["by_phase"]
    rise = by_phase["abuse"]["error_rate"] - by_phase["baseline"]["error_rate"]
    assert rise <= ERROR_RISE_MAX, by_phase
    res = soak["raw"]["resources"]
    assert res["fds_at_rest_after"] - res["fds_at_rest_before"] <= FDS_RETAINED_MAX, res
    goals = {g["name"]: g for g in soak["goals"]}
    missed = {name: goals[name]["measured"] for name in HOLDS if not goals[name]["met"]}
    assert missed == {}


@pytest.mark.slow
@pytest.mark.timeout(130)
def test_soak_samples_the_gateway_throughout(soak: dict[str, Any]) -> None:
    rows = soak["raw"]["samples"]["rows"]
    times = [r[0] for r in rows]
    assert times[0] < WINDOW
    assert times[-1] >= QUICK_DURATION
    # One sample a second, in order, from the start to the end of the run. How far apart
    # two samples are is the machine's doing, not a property to assert: with callgrind, a
    # bench of seven proxies and this suite on two CPUs, one gap was 8 s.
    assert times == sorted(times) and len(times) >= QUICK_DURATION // WINDOW
    assert all(r[1] > 10 * 2**20 and r[2] > 0 for r in rows)
    res = soak["raw"]["resources"]
    for key in ("rss_mid_abuse", "rss_end_of_abuse", "rss_at_rest_after", "rss_peak"):
        assert res[key] > 0, key
    assert {g["name"] for g in soak["goals"]} == set(GOALS)
    assert all(g["met"] is not None for g in soak["goals"])
    out: Path = soak["_out"]
    report = (out / "report.md").read_text()
    for plot in ("soak_resources.png", "soak_latency.png"):
        assert plot in soak["plots"]
        assert (out / plot).read_bytes()[:8] == PNG_MAGIC
        assert f"]({plot})" in report


@pytest.mark.slow
@pytest.mark.timeout(130)
def test_the_quick_soak_is_a_smoke_run_that_grades_no_goal(soak: dict[str, Any]) -> None:
    lines = (soak["_out"] / "report.md").read_text().splitlines()
    assert lines[2].startswith(f"**{SMOKE}.**") and soak["smoke"] is True
    assert [g["graded"] for g in soak["goals"]] == [False] * len(GOALS)
    goal_rows = [line for line in lines if line.startswith(tuple(f"| {g} |" for g in GOALS))]
    assert len(goal_rows) == len(GOALS)
    assert all(line.endswith(f"| {NOT_GRADED} |") for line in goal_rows)
    assert set(soak["plot_titles"]) == {"soak_resources.png", "soak_latency.png"}
    for titles in soak["plot_titles"].values():
        assert titles and all(title.startswith(SMOKE) for title in titles)


# --- pieces -------------------------------------------------------------------------------


def test_timeline_splits_the_duration_in_order() -> None:
    t = Timeline.of(30.0)
    assert [n for n, _, _ in t.bounds] == ["warm-up", "baseline", "abuse", "recovery"]
    assert t.bounds[0][1] == 0.0 and t.end == pytest.approx(30.0)
    assert all(a[2] == b[1] for a, b in itertools.pairwise(t.bounds))
    assert t.span("abuse") == pytest.approx((13.5, 24.0))
    assert t.phase_at(0.0) == "warm-up" and t.phase_at(13.5) == "abuse"
    assert t.phase_at(29.99) == "recovery"


def test_heavy_png_is_decoded_whole_then_refused() -> None:
    heavy = HeavyPng(max_pixels=10_000)
    assert (heavy.width, heavy.height) == (100, 100)
    one, two = heavy.copy(1), heavy.copy(2)
    # A unique chunk each: the gateway's verdict cache (by content hash) cannot answer.
    assert one != two and len(one) < 2_000
    with Image.open(io.BytesIO(one)) as image:
        assert image.size == (100, 100) and image.mode == "RGBA"
        with pytest.raises(OSError, match="truncated"):
            image.load()
    settings = MediaSettings(max_pixels=10_000)
    with pytest.raises(MediaInvalid):
        validate_image(one, "image/png", settings)
    # Whole, the same pixels are a valid image within the cap.
    whole = HeavyPng(max_pixels=10_000, cut=0).copy(1)
    assert validate_image(whole, "image/png", settings).width == 100


def test_pinned_defaults_are_the_gateways_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    env = pinned_defaults()
    defaults = Settings.model_construct()  # the declared defaults, no environment read
    assert env["GATEWAY_LIMITS__MAX_IN_FLIGHT"] == str(defaults.limits.max_in_flight)
    # An override such as a bench-wide one is undone: the gateway reads the defaults.
    monkeypatch.setenv("GATEWAY_LIMITS__MAX_IN_FLIGHT", "7")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pinned = Settings(api_keys=["k" * 20])
    for section in ("limits", "timeouts", "media"):
        assert getattr(pinned, section) == getattr(defaults, section), section


def test_legit_stats_count_errors_and_latency_of_successes() -> None:
    outcomes = [
        Outcome(0.0, "chat", "a", "baseline", 0.010, 200),
        Outcome(0.1, "chat", "a", "baseline", 0.030, 200),
        Outcome(0.2, "chat", "a", "baseline", 0.001, 503),
        Outcome(0.3, "stream", "a", "baseline", 0.020, 200, "stream cut"),
        Outcome(0.4, "chat", "a", "baseline", None, None, "timeout"),
    ]
    s = legit_stats(outcomes)
    assert (s["sent"], s["errors"]) == (5, 3)
    assert s["p50_ms"] == pytest.approx(10.0) and s["p99_ms"] == pytest.approx(30.0)
    assert s["ends"] == {"200": 2, "503": 1, "200 stream cut": 1, "timeout": 1}


@pytest.mark.parametrize(
    "argv",
    [
        ["soak", "--engine-url", "http://127.0.0.1:1", "--gateway-url", "http://127.0.0.1:2",
         "--api-key", "k"],
        ["overhead", "--duration", "30"],
        ["soak", "--duration", "0"],
    ],
)  # fmt: skip
def test_cli_refuses_what_the_soak_cannot_do(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
