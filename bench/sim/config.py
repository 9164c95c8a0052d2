"""Command-line options of the simulated engine, named like vLLM's own flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
VERSION = "0.33.0"


@dataclass(frozen=True)
class SimConfig:
    model: str = DEFAULT_MODEL
    runner: str = "generate"
    max_model_len: int = 32768
    kv_cache_tokens: int = 131072
    block_size: int = 16
    max_num_seqs: int = 64
    api_key: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    enable_runtime_lora: bool = False
    enable_responses_api_store: bool = False
    # Media fetches are confined to loopback addresses (guard.py) unless this is set.
    allow_remote_media: bool = False
    latency: str = "calibrated"
    record_requests: int = 0
    max_body_bytes: int = 256 * 1024 * 1024
    # Seconds the event loop is held per MiB of request body (0: not at all).
    loop_hold_per_mib: float = 0.0
    served_model_names: tuple[str, ...] = field(default=())
    # Routes answered 501 as vLLM answers a route its model does not serve.
    not_implemented: tuple[str, ...] = field(default=())

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    @property
    def zero(self) -> bool:
        return self.latency == "zero"


def parse_args(argv: Sequence[str] | None = None) -> tuple[str, int, SimConfig]:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim",
        description=(
            "A simulated vLLM engine: vLLM's routes, errors and metrics, with a latency "
            "model and a prefix cache, without a GPU (docs/sim.md). Named like vLLM's "
            "own flags. It reads no environment variables (GATEWAY_* are the gateway's)."
        ),
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=8001, help="port to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="the served model's name (default: %(default)s)"
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="names to serve the model under instead of --model (default: --model)",
    )
    p.add_argument(
        "--runner",
        choices=("generate", "pooling"),
        default="generate",
        help="which routes exist, as vLLM registers them by task (default: %(default)s)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=32768,
        metavar="N",
        help="context limit: prompt + max_tokens beyond it is a 400 (default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=131072,
        metavar="N",
        help="prefix cache capacity in tokens, LRU over N / block-size blocks "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        metavar="N",
        help="prefix cache block size in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        metavar="N",
        help="requests running at once; the rest wait (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on paths under /v1, /v2, /inference and "
        "/cohere, as vLLM (default: none)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        metavar="HOST",
        help="hosts media URLs may name (default: any host, on loopback addresses only)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="allow file: media URLs under DIR (default: none)",
    )
    p.add_argument(
        "--enable-runtime-lora",
        action="store_true",
        help="mount vLLM's LoRA adapter loading routes (default: off)",
    )
    p.add_argument(
        "--enable-responses-api-store",
        action="store_true",
        help="mount /v1/responses with vLLM's response store (vLLM: "
        "VLLM_ENABLE_RESPONSES_API_STORE=1): a response kept under its request_id, read "
        "back at GET /v1/responses/{id} (default: off, no /v1/responses)",
    )
    p.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="let media URLs reach addresses outside loopback; no test or benchmark does "
        "(default: off)",
    )
    p.add_argument(
        "--latency",
        choices=("calibrated", "zero"),
        default="calibrated",
        help="calibrated: a GPU's timings, modelled; zero: answer at once, for overhead "
        "benchmarks (default: %(default)s)",
    )
    p.add_argument(
        "--record-requests",
        type=int,
        default=0,
        metavar="N",
        help="keep the last N requests and serve them at GET/DELETE /sim/requests "
        "(default: 0, off)",
    )
    p.add_argument(
        "--loop-hold-per-mib",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="hold the event loop this long per MiB of each request body, as vLLM's API "
        "server holds its loop parsing and validating a large body: health checks and "
        "other requests wait meanwhile (default: 0)",
    )
    p.add_argument(
        "--not-implemented",
        nargs="+",
        default=[],
        metavar="PATH",
        help="answer POST PATH 501 NotImplementedError, as vLLM 0.32 answers a route its "
        "model does not serve (/v1/systemone on every architecture but six) (default: none)",
    )
    a = p.parse_args(argv)
    if a.block_size < 1 or a.max_model_len < 1 or a.max_num_seqs < 1:
        p.error("--block-size, --max-model-len and --max-num-seqs must be positive")
    if not 0 <= a.loop_hold_per_mib <= 60:
        p.error("--loop-hold-per-mib must be between 0 and 60")
    config = SimConfig(
        model=a.model,
        runner=a.runner,
        max_model_len=a.max_model_len,
        kv_cache_tokens=a.kv_cache_tokens,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        api_key=a.api_key,
        allowed_media_domains=tuple(a.allowed_media_domains),
        allowed_local_media_path=a.allowed_local_media_path,
        enable_runtime_lora=a.enable_runtime_lora,
        enable_responses_api_store=a.enable_responses_api_store,
        allow_remote_media=a.allow_remote_media,
        latency=a.latency,
        record_requests=max(0, a.record_requests),
        served_model_names=tuple(a.served_model_name),
        loop_hold_per_mib=a.loop_hold_per_mib,
        not_implemented=tuple(a.not_implemented),
    )
    return a.host, a.port, config
