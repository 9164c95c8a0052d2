"""Real vLLM engines for routing runs: a fleet, or the ideal engine, started once and
reset between front ends.

The engines run with `VLLM_SERVER_DEV_MODE=1`, so that `POST /reset_prefix_cache`,
`/reset_mm_cache` and `/reset_encoder_cache` (vllm/entrypoints/serve/dev/cache/
api_router.py) empty them between runs: a prefix-cache reset answers
`{"success": false}` while blocks are held and is retried. Fleet engines use one
OpenMP thread each, unbound, so the OS spreads the busy ones over the cores; the ideal
engine has the fleet's KV blocks and every core of this process.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from bench.harness.metrics import scrape, total
from bench.harness.realvllm.home import Home
from bench.harness.realvllm.launcher import Engine, free_port, start_all
from bench.harness.realvllm.models import MULTIMODAL_BIG, MULTIMODAL_SMALL, ROUTING, WORDS
from bench.harness.server import ROOT
from bench.suites.routing.real_workloads import FULL, png_data_url

# The CPU backend caches in blocks of 128 tokens.
BLOCK_TOKENS = 128
# CPU flags of native bfloat16 arithmetic. Without one, PyTorch computes bfloat16 on the
# CPU about 30 times slower than float32 (docs/facts.md).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of /proc/cpuinfo's first processor (empty when it names none)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def engine_dtype(requested: str, cpuinfo: str | None = None) -> str:
    """`requested`, or for "auto" bfloat16 where the CPU computes it natively and
    float32 elsewhere."""
    if requested != "auto":
        return requested
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    return "bfloat16" if cpu_flags(cpuinfo) & BF16_FLAGS else "float32"


# vLLM's line per request with --enable-log-requests (vllm/v1/engine/async_llm.py):
# "Added request chatcmpl-<X-Request-Id>-<8 hex>." (vllm/v1/engine/input_processor.py
# appends the 8 hex digits).
_ADDED = re.compile(r"Added request (?:chatcmpl|cmpl)-(\S+)-[0-9a-f]{8}\.\s*$", re.M)


@dataclass
class Counters:
    """An engine's own counters: prefix-cache tokens queried and found, requests done."""

    queries: float = 0.0
    hits: float = 0.0
    requests: float = 0.0

    @classmethod
    def of(cls, url: str) -> Counters:
        samples = scrape(url + "/metrics", timeout=10)
        return cls(
            queries=total(samples, "vllm:prefix_cache_queries_total"),
            hits=total(samples, "vllm:prefix_cache_hits_total"),
            requests=total(samples, "vllm:request_success_total"),
        )

    def minus(self, other: Counters) -> Counters:
        return Counters(
            self.queries - other.queries, self.hits - other.hits, self.requests - other.requests
        )


# The fleet engines' executor, as environment. "mp", vLLM's default on a CPU: the model
# runs in a worker process that spins for a second after every step, so an engine that
# just served takes CPU from its neighbours on a small host. "uni": the model runs in the
# engine core's process, as in a one-GPU engine; the API server stays a process of its
# own (docs/facts.md, "The CPU build's worker spins").
EXECUTORS: dict[str, dict[str, str]] = {
    "uni": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "mp": {},
}


@dataclass
class EngineSet:
    """Engines serving one model. The caller must `stop()` it."""

    model: str
    count: int
    # KV blocks per engine (None: VLLM_CPU_KVCACHE_SPACE's whole GiB).
    blocks: int | None = None
    ideal: bool = False
    max_model_len: int | None = 4096
    # "auto": engine_dtype().
    dtype: str = "auto"
    # The fleet engines' (EXECUTORS). The ideal engine keeps vLLM's worker process, which
    # binds its threads to every CPU (its TTFT is not compared).
    executor: str = "uni"
    home: Home = field(default_factory=Home.default)
    engines: list[Engine] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _engine(self, index: int) -> Engine:
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if self.ideal:
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_list(sorted(os.sched_getaffinity(0)))
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.count)
        else:
            env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
            env.update(EXECUTORS[self.executor])
        args = [
            "--dtype",
            engine_dtype(self.dtype),
            "--enable-log-requests",
            "--enable-prompt-tokens-details",
        ]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.blocks is not None:
            blocks = self.blocks * self.count if self.ideal else self.blocks
            args += ["--num-gpu-blocks-override", str(blocks)]
        port = free_port()
        label = "ideal" if self.ideal else f"fleet{index}"
        return Engine(
            self.model,
            served_name=self.model,
            args=args,
            env=env,
            port=port,
            workdir=self.home.run / f"{label}-{port}",
            home=self.home,
        )

    def start(self) -> EngineSet:
        """Start the engines side by side, run a few prompts of each length through each
        (first-use costs), then reset them."""
        ensure_models(self.home, [self.model])
        self.engines = start_all([self._engine(i) for i in range(1 if self.ideal else self.count)])
        try:
            self._warm_up()
            self.reset()
        except BaseException:
            self.stop()
            raise
        return self

    def _warm_up(self) -> None:
        rng = random.Random(99)
        # The vision tower's first use at each image shape costs the engine tens of
        # milliseconds more than later ones (measured: the first front end of a fresh
        # fleet had the slowest first images); every shape of the workloads' images.
        shapes = (
            itertools.product(FULL.sides, FULL.sides)
            if self.model in (MULTIMODAL_BIG, MULTIMODAL_SMALL)
            else ()
        )
        images = [png_data_url(rng, width, height) for width, height in shapes]
        for url in self.urls:
            for count in (50, 300, 1000):
                prompt = " ".join(rng.choice(WORDS) for _ in range(count))
                self._post(url, "/v1/completions", {"prompt": prompt})
            for image in images:
                content = [{"type": "image_url", "image_url": {"url": image}},
                           {"type": "text", "text": "Describe it."}]  # fmt: skip
                self._post(url, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": content}]})  # fmt: skip

    def _post(self, url: str, path: str, body: dict[str, object]) -> None:
        resp = httpx.post(url + path, json={"model": self.model, "max_tokens": 2, **body},
                          timeout=300)  # fmt: skip
        if resp.status_code != 200:
            raise RuntimeError(f"warm-up of {url}: {resp.status_code} {resp.text[:300]}")

    def reset(self) -> None:
        """Empty every engine's prefix, multimodal and encoder caches."""
        for url in self.urls:
            for _ in range(40):
                resp = httpx.post(url + "/reset_prefix_cache", timeout=30)
                if resp.status_code == 200 and resp.json().get("success") is True:
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"the prefix cache of {url} was not reset: {resp.text[:200]}")
            for path in ("/reset_mm_cache", "/reset_encoder_cache"):
                httpx.post(url + path, timeout=30).raise_for_status()

    def counters(self) -> list[Counters]:
        return [Counters.of(url) for url in self.urls]

    def log_marks(self) -> list[int]:
        return [len(e.log()) for e in self.engines]

    def served(self, marks: Sequence[int]) -> dict[str, int]:
        """X-Request-Id a client sent -> index of the engine that received it, from the
        engines' request logs after `marks` (a gateway appends `-` and 16 hex digits)."""
        out: dict[str, int] = {}
        for index, (engine, mark) in enumerate(zip(self.engines, marks, strict=True)):
            for request_id in _ADDED.findall(engine.log()[mark:]):
                client, sep, suffix = request_id.rpartition("-")
                out[client if sep and len(suffix) == 16 else request_id] = index
        return out

    def kv_tokens(self) -> list[int]:
        """Each engine's KV capacity in tokens, as it logged it."""
        out = []
        for engine in self.engines:
            found = re.findall(r"KV cache size: ([\d,]+) tokens", engine.log())
            out.append(int(found[-1].replace(",", "")) if found else -1)
        return out

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def ensure_models(home: Home, names: Sequence[str]) -> None:
    """Build the routing models named that are missing (about 10 s each, nothing
    downloaded)."""
    missing = [n for n in names if n in ROUTING and not home.model(n).is_dir()]
    if not missing:
        return
    command = [str(home.python), "-m", "bench.harness.realvllm.models", str(home.models)]
    subprocess.run([*command, "--only", ",".join(missing)], cwd=ROOT, check=True)
