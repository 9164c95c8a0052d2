"""Simulated engines in place of vLLM for the real-engine workloads
(`bench routing --real-vllm --sim-engines`): each engine a `bench.sim` process with its
own serialized "GPU" (the simulator's calibrated latency), so one engine's prefill never
slows another's, as on a fleet of one GPU per engine. On the small CPU host of the real
runs the engines share two cores, and a first prefill's time moves by hundreds of
milliseconds from run to run with whatever its neighbours compute; here only the
placement decides who waits.

The simulator counts a token per 4 bytes of UTF-8 where the real models count one per
word of the workloads' word list (`SIM_TOKENS_PER_WORD` of them), so the KV capacities
are scaled by that ratio: as many prompts fit an engine as fit the real one.
Between runs the engines are restarted, which empties their caches as a reset does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from bench.harness.realvllm.models import WORDS
from bench.harness.server import Server
from bench.sim.engine import BASE_TTFT, DECODE_STEP, PREFILL_TOKENS_PER_S
from bench.suites.fleet import CpuPlan, Fleet
from bench.suites.routing.engine_set import BLOCK_TOKENS, Counters
from bench.suites.routing.live import served

# The simulator's tokens per word of the workloads (a word and its space, 4 bytes a token).
SIM_TOKENS_PER_WORD = sum(len(w) + 1 for w in WORDS) / len(WORDS) / 4
# A real engine's KV capacity with the default KV space (llama-big, vLLM 0.32's CPU
# build, 128-token blocks), in its tokens.
DEFAULT_KV_TOKENS = 209_664


def sim_kv_tokens(real_tokens: int) -> int:
    """The simulator's KV tokens holding what `real_tokens` of a real engine hold, in
    whole 128-token blocks."""
    blocks = -(-round(real_tokens * SIM_TOKENS_PER_WORD) // BLOCK_TOKENS)
    return blocks * BLOCK_TOKENS


def describe() -> str:
    """The simulated engines' latency model, for a report's meta."""
    return (
        f"simulated (bench.sim, calibrated: {BASE_TTFT * 1000:.0f} ms + prefill at "
        f"{PREFILL_TOKENS_PER_S:,.0f} tokens/s on a serialized GPU per engine, "
        f"{DECODE_STEP * 1000:.0f} ms per output token), 128-token KV blocks, KV scaled "
        f"x{SIM_TOKENS_PER_WORD:.2f} to the simulator's tokens"
    )


@dataclass
class SimEngineSet:
    """Simulated engines serving one model: `EngineSet`'s interface. The caller must
    `stop()` it."""

    model: str
    count: int
    workdir: Path
    # KV blocks per engine, of 128 real tokens (None: a real engine's default KV).
    blocks: int | None = None
    ideal: bool = False
    servers: list[Server] = field(default_factory=list)
    _fleet: Fleet | None = None

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def _kv_tokens(self) -> int:
        real = DEFAULT_KV_TOKENS if self.blocks is None else self.blocks * BLOCK_TOKENS
        return sim_kv_tokens(real) * (self.count if self.ideal else 1)

    def start(self) -> SimEngineSet:
        fleet = self._fleet = Fleet(self.workdir, CpuPlan(None, None))
        args = ["--model", self.model, "--kv-cache-tokens", str(self._kv_tokens())]
        # The recorder tells which engine served each call (`served`).
        args += ["--block-size", str(BLOCK_TOKENS), "--record-requests", "50000"]
        label = "sim-ideal" if self.ideal else "sim-fleet"
        starts = [
            partial(fleet.sim, *args, name=f"{label}{i}")
            for i in range(1 if self.ideal else self.count)
        ]
        self.servers = fleet.at_once(*starts)
        return self

    def reset(self) -> None:
        """Empty every engine's caches and counters: start them again."""
        self.stop()
        self.start()

    def counters(self) -> list[Counters]:
        return [Counters.of(url) for url in self.urls]

    def log_marks(self) -> list[int]:
        # A restarted engine's recorder holds only this run's requests.
        return [0 for _ in self.servers]

    def served(self, marks: Sequence[int]) -> dict[str, int]:
        return served(self.urls)

    def kv_tokens(self) -> list[int]:
        return [self._kv_tokens() for _ in self.servers]

    def stop(self) -> None:
        if self._fleet is not None:
            self._fleet.close()
            self._fleet = None
        self.servers = []
