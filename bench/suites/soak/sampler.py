"""Samples of one process's resident memory, open file descriptors and CPU time, taken
every second by a thread while a `with` block runs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.harness.background import InThread
from bench.harness.process_tree import cpu_seconds


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the run's start
    rss: int  # bytes, VmRSS
    fds: int
    cpu: float  # user + system seconds so far


def vm_rss(pid: int) -> int | None:
    """VmRSS of `pid` in bytes (/proc/<pid>/status), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class ProcessSampler(InThread):
    """`samples` of `pid` every `interval` seconds, times counted from `t0` (monotonic);
    `watch` sees each sample as it is taken (in the sampler's thread)."""

    def __init__(
        self,
        pid: int,
        t0: float,
        interval: float = 1.0,
        watch: Callable[[Sample], None] | None = None,
    ) -> None:
        self.pid, self.t0, self.interval, self.watch = pid, t0, interval, watch
        self.samples: list[Sample] = []
        self._done = threading.Event()
        super().__init__()

    def run(self) -> None:
        next_at = time.monotonic()
        while not self._done.is_set():
            rss, fds = vm_rss(self.pid), open_fds(self.pid)
            if rss is not None and fds is not None:
                now = time.monotonic() - self.t0
                sample = Sample(round(now, 3), rss, fds, cpu_seconds(self.pid))
                self.samples.append(sample)
                if self.watch is not None:
                    self.watch(sample)
            next_at += self.interval
            self._done.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._done.set()
