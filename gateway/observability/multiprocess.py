"""Metrics of every worker of `serve --workers N` in one scrape, through prometheus_client's
multiprocess files.

Each worker keeps its ordinary registry (plain integer adds per request) and copies what
`registry.collect()` yields into prometheus_client's own file format (`MmapedDict`, one
file per metric kind and process, named as `prometheus_client.multiprocess` reads them)
once a second, at shutdown, and right before it answers a scrape. A scrape then merges
every worker's files with `MultiProcessCollector`, in a thread. prometheus_client's own
multiprocess mode writes the file on every `inc()`: ~3.3 us an increment against
~0.1 us for the adds the gateway does (bench/suites/metrics_files.py).

How the files merge:
- Counters and histograms are summed, and the files of a worker that exited stay: a
  restarted worker starts its own files, so no total goes backwards.
- Gauges are "live": the files of a worker that is gone are deleted (its own shutdown
  does it; a merge does it for a worker that died), and each gauge merges by what its
  HELP text says: "summed over workers", "the lowest" or "the highest" (over workers).

With one worker nothing here runs: /metrics renders the registry as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

log = structlog.get_logger("gateway.metrics")

# What `serve --workers N` hands each worker: the private directory of the metric files
# and the number of workers.
METRICS_DIR_ENV = "VLLM_GATEWAY_METRICS_DIR"
WORKERS_ENV = "VLLM_GATEWAY_WORKERS"

# Seconds between two copies of a worker's registry into its files: what a scrape
# answered by another worker can miss of this one's counts.
COPY_INTERVAL = 1.0

# The phrase of a gauge's HELP text -> the merge of prometheus_client's multiprocess
# mode it selects. Live modes: a worker that is gone leaves the gauge.
GAUGE_MERGES: Mapping[str, str] = {
    "summed over workers": "livesum",
    "the lowest": "livemin",
    "the highest": "livemax",
}
DEFAULT_GAUGE_MERGE = "livesum"


def gauge_merge(documentation: str) -> str | None:
    """The merge a gauge's HELP text selects; None when it names none, or more than one."""
    found = [mode for phrase, mode in GAUGE_MERGES.items() if phrase in documentation]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class Workers:
    """The processes a gateway runs as: how many workers, and where they share their
    metrics (None: one worker, no files)."""

    count: int = 1
    directory: Path | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Workers:
        """What `serve` handed a worker (`shared_directory`); one worker without it."""
        directory = environ.get(METRICS_DIR_ENV)
        if not directory:
            return cls()
        return cls(int(environ.get(WORKERS_ENV, "1")), Path(directory))


@contextlib.contextmanager
def shared_directory(workers: int) -> Iterator[Path]:
    """A private directory (mode 0700) for the metric files of `workers` worker processes,
    named to them through the environment they inherit; removed on leaving, with the
    files of every worker."""
    path = Path(tempfile.mkdtemp(prefix="vllm-gateway-metrics-"))
    os.environ[METRICS_DIR_ENV] = str(path)
    os.environ[WORKERS_ENV] = str(workers)
    try:
        yield path
    finally:
        os.environ.pop(METRICS_DIR_ENV, None)
        os.environ.pop(WORKERS_ENV, None)
        shutil.rmtree(path, ignore_errors=True)


def sibling_alive(pid: int) -> bool:
    """Whether `pid` is a running worker: a live child of this worker's parent (a pid
    reused by another process, or a zombie not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        # No /proc (not Linux): whether any process has the pid.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    state, ppid = stat.rpartition(")")[2].split()[:2]
    return state != "Z" and int(ppid) == os.getppid()


class _File:
    """One of this worker's files: the values last written, by key."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = MmapedDict(str(path))
        self.written: dict[str, float] = {}

    def write(self, values: dict[str, float]) -> None:
        data, written = self.data, self.written
        for key, value in values.items():
            if written.get(key) != value:
                data.write_value(key, value, 0.0)
                written[key] = value

    def replace(self, values: dict[str, float]) -> None:
        """Write only `values`: the keys no longer there leave (a gauge whose series went
        away). A new file renamed over the old one: a merge reads one or the other."""
        fresh = self.path.with_suffix(".tmp")
        fresh.unlink(missing_ok=True)
        data = MmapedDict(str(fresh))
        for key, value in values.items():
            data.write_value(key, value, 0.0)
        os.replace(fresh, self.path)
        self.data.close()
        self.data, self.written = data, dict(values)

    def close(self) -> None:
        self.data.close()


class MetricFiles:
    """This worker's copy of `registry` in the shared `directory`, and the merge of every
    worker's copies. Not thread safe: `copy` runs on the event loop (it reads the
    registry the requests update there); `merge` reads only files, in a thread."""

    def __init__(
        self,
        registry: CollectorRegistry,
        directory: Path,
        *,
        pid: int | None = None,
        alive: Callable[[int], bool] = sibling_alive,
    ) -> None:
        """`pid`: this worker's (default: this process's); `alive`: whether another
        worker's pid still runs (default: a live child of this worker's parent)."""
        self.registry = registry
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self._alive = alive
        self._files: dict[str, _File] = {}
        # (sample name, label values) -> the file's key for it: json.dumps per sample
        # per copy was most of the copy's cost.
        self._keys: dict[tuple[str, tuple[str, ...]], str] = {}
        self._retire_previous()

    def _retire_previous(self) -> None:
        """Files with this pid are a dead process's (the pid was reused): its gauges go,
        its counters and histograms stay under another name, still summed."""
        for path in self.directory.glob(f"*_{self.pid}.db"):
            if path.name.startswith("gauge_"):
                path.unlink(missing_ok=True)
            else:
                retired = f"{path.stem}-{secrets.token_hex(4)}.db"
                os.replace(path, path.with_name(retired))

    def _file(self, name: str) -> _File:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = _File(self.directory / f"{name}_{self.pid}.db")
        return f

    def _key(self, family: Metric, sample: str, labels: dict[str, str]) -> str:
        cache = (sample, tuple(labels.values()))
        key = self._keys.get(cache)
        if key is None:
            key = mmap_key(
                family.name, sample, list(labels), list(labels.values()), family.documentation
            )
            self._keys[cache] = key
        return key

    def snapshot(self) -> dict[str, dict[str, float]]:
        """The registry as files: file name (without the pid) -> key -> value."""
        files: dict[str, dict[str, float]] = {}
        for family in self.registry.collect():
            kind = family.type
            if kind == "histogram":
                self._histogram(family, files.setdefault("histogram", {}))
                continue
            if kind in ("counter", "summary"):
                values = files.setdefault(kind, {})
            else:
                mode = gauge_merge(family.documentation) or DEFAULT_GAUGE_MERGE
                values = files.setdefault(f"gauge_{mode}", {})
            for s in family.samples:
                if not s.name.endswith("_created"):
                    values[self._key(family, s.name, s.labels)] = s.value
        return files

    def _histogram(self, family: Metric, values: dict[str, float]) -> None:
        # prometheus_client's files hold each bucket's own count (the merge cumulates
        # them, and counts `_count` from them) and the sum.
        bucket = family.name + "_bucket"
        below: dict[tuple[str, ...], float] = {}
        for s in family.samples:
            if s.name == bucket:
                series = tuple(v for k, v in s.labels.items() if k != "le")
                previous = below.get(series, 0.0)
                below[series] = s.value
                values[self._key(family, s.name, s.labels)] = s.value - previous
            elif s.name == family.name + "_sum":
                values[self._key(family, s.name, s.labels)] = s.value

    def copy(self) -> None:
        """Write this worker's registry into its files (on the event loop)."""
        for name, values in self.snapshot().items():
            f = self._file(name)
            if name.startswith("gauge_") and not f.written.keys() <= values.keys():
                f.replace(values)
            else:
                f.write(values)

    def merge(self) -> bytes:
        """Every worker's files as one Prometheus text: run it in a thread. The live
        gauges of workers that are gone are deleted first."""
        for path in self.directory.glob("gauge_live*_*.db"):
            pid = path.stem.rpartition("_")[2]
            if pid.isdigit() and int(pid) != self.pid and not self._alive(int(pid)):
                path.unlink(missing_ok=True)
        merged = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(merged, str(self.directory))
        for _ in range(2):
            try:
                return generate_latest(merged)
            except FileNotFoundError:
                # A starting worker renamed a dead one's file (_retire_previous) between
                # the collector's listing and its read: list again.
                continue
        return generate_latest(merged)

    async def render(self) -> bytes:
        """The whole gateway's metrics: this worker's copied first, so a scrape counts
        everything this worker answered before it."""
        self.copy()
        return await asyncio.to_thread(self.merge)

    def close(self) -> None:
        """The last copy, as the worker leaves: its counters and histograms stay for the
        merge, its gauges go."""
        self.copy()
        for f in self._files.values():
            f.close()
            if f.path.name.startswith("gauge_"):
                f.path.unlink(missing_ok=True)
        self._files.clear()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Copy every COPY_INTERVAL while the block runs, and once more on leaving."""
        task = asyncio.create_task(self._copy_periodically(), name="metric-files")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.close()

    async def _copy_periodically(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(COPY_INTERVAL)
            try:
                self.copy()
            except OSError:
                # The directory's file system (full, removed): logged once, tried again
                # each interval; the worker's own registry keeps counting.
                if not failing:
                    log.exception("metric_files_failed", directory=str(self.directory))
                failing = True
            else:
                failing = False
