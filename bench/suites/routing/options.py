"""What a routing run measures: its options, the model, the paths that count."""

from __future__ import annotations

from dataclasses import dataclass, field

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")
MODEL = "Qwen/Qwen3-VL-2B-Instruct"


@dataclass
class Options:
    engines: int = 4
    kv_cache_tokens: int = 16384
    concurrency: int = 16
    # Sessions open at once (users between turns included); see `replay`.
    live: int = 64
    scale: float = 1.0
    workloads: list[str] = field(
        default_factory=lambda: ["chat", "few_shot", "images", "templates"]
    )
    fronts: list[str] = field(default_factory=list)
    # Gateway (and vllm-router) replicas taking requests in turn, one front end each.
    replicas: list[int] = field(default_factory=lambda: [1, 2, 4])
    load_epsilon: float | None = None
    # Also run affinity with the shared placement store (a redis-server per row).
    store: bool = False
    gateway_env: dict[str, str] = field(default_factory=dict)
