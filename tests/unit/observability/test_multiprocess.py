"""Workers' metric files (observability/multiprocess.py): what each worker copies and what
a scrape merges, as tables of small cases on real files. Two registries in this process
stand for two workers, each named by its own pid; which of them still runs is handed in
(`alive`), as the process table would answer it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config.settings import Settings
from gateway.observability.metrics import Metrics
from gateway.observability.multiprocess import (
    METRICS_DIR_ENV,
    WORKERS_ENV,
    MetricFiles,
    Workers,
    gauge_merge,
    shared_directory,
    sibling_alive,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
A, B = 1001, 1002


def samples(text: bytes, kinds: tuple[str, ...] = ("counter", "histogram", "gauge")) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.type not in kinds:
            continue
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def busy(metrics: Metrics, requests: int, key: str) -> None:
    """`requests` answered for `key`, each with tokens, a latency and a time to first byte;
    one in four refused."""
    for i in range(requests):
        refused = i % 4 == 0
        status, code = (429, "rate_limited") if refused else (200, "")
        metrics.observe_request("inference", status, code, 0.002 * i, refused, key)
        metrics.observe_usage(key, 7, i)
        metrics.observe_ttfb("inference", 0.001 * i)


Workers_ = Callable[..., list[MetricFiles]]


@pytest.fixture
def workers() -> Iterator[Workers_]:
    """`workers(directory, *registries, live=pids)`: one worker's files per registry
    (pids A, B, ...), with `live` the pids that still run; closed at the end."""
    opened: list[MetricFiles] = []

    def start(directory: Path, *registries: CollectorRegistry, live: set[int]) -> list[MetricFiles]:
        files = [
            MetricFiles(r, directory, pid=A + i, alive=live.__contains__)
            for i, r in enumerate(registries)
        ]
        opened.extend(files)
        return files

    yield start
    for f in opened:
        f.close()


def test_counters_and_histograms_merge_to_the_sum_of_the_workers(
    tmp_path: Path, workers: Workers_
) -> None:
    first, second = Metrics(), Metrics()
    busy(first, 13, "alice")
    busy(second, 11, "alice")
    busy(second, 5, "bob")
    files = workers(tmp_path, first.registry, second.registry, live={A, B})
    for f in files:
        f.copy()
    merged = samples(files[0].merge(), ("counter", "histogram"))
    one, two = (samples(m.render(), ("counter", "histogram")) for m in (first, second))
    expected = {k: one.get(k, 0.0) + two.get(k, 0.0) for k in one.keys() | two.keys()}
    assert merged.keys() == expected.keys()
    for k, value in expected.items():
        assert merged[k] == pytest.approx(value), k
    assert merged[("gateway_requests_total", (("code", ""), ("group", "inference"),
                   ("key", "alice"), ("status", "200")))] == 9 + 8  # fmt: skip
    # What a worker counts after its copy shows at its next one.
    busy(first, 4, "bob")
    assert samples(files[0].merge(), ("counter", "histogram")) == merged
    files[0].copy()
    after = samples(files[1].merge(), ("counter",))
    assert after[("gateway_prompt_tokens_total", (("key", "bob"),))] == 7 * (5 + 4)


def gauges(registry: CollectorRegistry) -> dict[str, Gauge]:
    helps = {"sum": "summed over workers", "min": "the lowest", "max": "the highest"}
    return {
        mode: Gauge(f"g_{mode}", f"A gauge, {help_}.", ["engine"], registry=registry)
        for mode, help_ in helps.items()
    }


@pytest.mark.parametrize(
    ("values_a", "values_b", "live", "expected"),
    [
        # Both run: summed, the lowest, the highest.
        ((3, 1, 1), (4, 0, 5), {A, B}, (7, 0, 5)),
        ((3, 1, 1), (4, 1, 0.25), {A, B}, (7, 1, 1)),
        # B is gone: its gauges leave, whatever they said.
        ((3, 1, 1), (4, 0, 5), {A}, (3, 1, 1)),
    ],
)
def test_gauges_merge_as_their_help_says(
    tmp_path: Path,
    workers: Workers_,
    values_a: tuple[float, ...],
    values_b: tuple[float, ...],
    live: set[int],
    expected: tuple[float, ...],
) -> None:
    ra, rb = CollectorRegistry(), CollectorRegistry()
    for registry, values in ((ra, values_a), (rb, values_b)):
        for gauge, v in zip(gauges(registry).values(), values, strict=True):
            gauge.labels("e1").set(v)
    files = workers(tmp_path, ra, rb, live=live)
    for f in files:
        f.copy()
    merged = samples(files[0].merge())
    got = tuple(merged[(f"g_{m}", (("engine", "e1"),))] for m in ("sum", "min", "max"))
    assert got == expected


def test_a_gone_worker_keeps_its_counts(tmp_path: Path, workers: Workers_) -> None:
    first, second = Metrics(), Metrics()
    busy(first, 3, "alice")
    busy(second, 5, "alice")
    first.count_in_flight(lambda: 2.0)
    second.count_in_flight(lambda: 9.0)
    files = workers(tmp_path, first.registry, second.registry, live={A})
    for f in files:
        f.copy()
    merged = samples(files[0].merge())
    assert merged[("gateway_requests_in_flight", ())] == 2.0
    assert merged[("gateway_prompt_tokens_total", (("key", "alice"),))] == 7 * 8
    assert merged[("gateway_request_duration_seconds_count", (("group", "inference"),))] == 8
    # The merge deleted the gone worker's gauges, not its counts.
    names = sorted(p.name for p in tmp_path.glob("*.db"))
    assert [n for n in names if n.endswith(f"_{B}.db")] == [f"counter_{B}.db", f"histogram_{B}.db"]


def test_a_worker_that_leaves_keeps_its_counts_and_takes_its_gauges(
    tmp_path: Path, workers: Workers_
) -> None:
    first, second = Metrics(), Metrics()
    busy(first, 3, "alice")
    busy(second, 5, "alice")
    second.count_in_flight(lambda: 9.0)
    files = workers(tmp_path, first.registry, second.registry, live={A, B})
    files[0].copy()
    busy(second, 2, "alice")
    # Its last copy, at shutdown, counts what it answered since the periodic one.
    files[1].close()
    merged = samples(files[0].merge())
    assert merged[("gateway_prompt_tokens_total", (("key", "alice"),))] == 7 * 10
    assert ("gateway_requests_in_flight", ()) not in merged or merged[
        ("gateway_requests_in_flight", ())
    ] == 0.0
    assert not list(tmp_path.glob(f"gauge_*_{B}.db"))


DEAD_WORKER = """
import sys
import tempfile
from pathlib import Path
from gateway.observability.metrics import Metrics
from gateway.observability.multiprocess import MetricFiles
metrics = Metrics()
for i in range(8):
    metrics.observe_request("inference", 200, "", 0.01, False, "alice")
    metrics.observe_usage("alice", 7, 1)
metrics.count_in_flight(lambda: 5.0)
MetricFiles(metrics.registry, Path(sys.argv[1]), pid=int(sys.argv[2])).copy()
"""


def test_a_reused_pid_adds_to_the_dead_workers_counts(tmp_path: Path, workers: Workers_) -> None:
    """A new worker given a dead one's pid keeps that worker's counts in the total: its
    own files start empty, the dead one's stay under another name (the dead worker: a
    process that copied its counts and ended without closing them)."""
    subprocess.run([sys.executable, "-c", DEAD_WORKER, str(tmp_path), str(A)], check=True)
    reborn = Metrics()
    busy(reborn, 4, "alice")
    [files] = workers(tmp_path, reborn.registry, live={A})
    files.copy()
    merged = samples(files.merge())
    assert merged[("gateway_prompt_tokens_total", (("key", "alice"),))] == 7 * 12
    assert merged[("gateway_request_duration_seconds_count", (("group", "inference"),))] == 12
    assert merged.get(("gateway_requests_in_flight", ()), 0.0) == 0.0


def test_a_gauge_series_that_went_away_leaves_the_merge(tmp_path: Path, workers: Workers_) -> None:
    registry = CollectorRegistry()
    gauge = gauges(registry)["max"]
    gauge.labels("e1").set(3)
    gauge.labels("e2").set(4)
    [files] = workers(tmp_path, registry, live={A})
    files.copy()
    assert samples(files.merge()).get(("g_max", (("engine", "e2"),))) == 4
    # An engine the pool dropped (DNS): its series is gone from the registry.
    gauge.remove("e2")
    gauge.labels("e1").set(6)
    files.copy()
    merged = samples(files.merge())
    assert ("g_max", (("engine", "e2"),)) not in merged
    assert merged[("g_max", (("engine", "e1"),))] == 6


@pytest.mark.parametrize(
    ("documentation", "mode"),
    [
        ("Requests in flight, summed over workers.", "livesum"),
        ("1 when healthy; the lowest over workers.", "livemin"),
        ("Queued in the engine; the highest over workers.", "livemax"),
        ("Open connections in this process.", None),
        ("the lowest or the highest of them.", None),
    ],
)
def test_a_gauges_help_names_its_merge(documentation: str, mode: str | None) -> None:
    assert gauge_merge(documentation) == mode


def test_every_gauge_says_how_workers_merge_it() -> None:
    """Every gauge the gateway registers (the store's included) says in its HELP how a
    scrape merges the workers' values: a gauge added without saying it fails here."""
    settings = Settings(
        engines=["http://127.0.0.1:9"],
        api_keys=["sk-unit-multiprocess-0123456789"],
        routing={"policy": "affinity", "store_url": "redis://127.0.0.1:9/0"},
    )
    registry = create_app(settings).metrics.registry
    found = [f for f in registry.collect() if f.type == "gauge"]
    assert len(found) >= 9
    silent = [f.name for f in found if gauge_merge(f.documentation) is None]
    assert not silent, f"gauges whose HELP says no merge (multiprocess.GAUGE_MERGES): {silent}"


def test_a_worker_is_a_running_child_of_this_ones_parent() -> None:
    assert sibling_alive(os.getpid())
    # A child of this process is not a worker beside it; once reaped, its pid is no one's.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not sibling_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not sibling_alive(child.pid)


def test_the_shared_directory_is_private_named_to_workers_and_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    with shared_directory(3) as directory:
        assert directory.parent == tmp_path
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert Workers.from_env(os.environ) == Workers(3, directory)
        files = MetricFiles(Metrics().registry, directory)
        files.copy()
        assert list(directory.glob("*.db"))
        files.close()
    assert not directory.exists()
    assert Workers.from_env(os.environ) == Workers(1, None)
    assert WORKERS_ENV not in os.environ
