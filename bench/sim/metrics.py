"""Prometheus text of the simulated engine, with vLLM's metric names and labels.

Hand-written rather than prometheus_client: the simulator updates a dozen series per
request, and at the >10,000 req/s the overhead benchmark needs, plain integer
attributes keep that cost out of the measurement.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

# Bucket bounds from vllm/v1/metrics/loggers.py.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {running}')
        running += self.counts[-1]
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {running}')
        lines.append(f"{self.name}_count{{{labels}}} {running}")
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        return lines


class Metrics:
    """Every series the simulator exports. Counters are plain attributes."""

    COUNTERS = (
        ("prefix_cache_queries", "Prefix cache queries, in tokens."),
        ("prefix_cache_hits", "Prefix cache hits, in tokens."),
        ("mm_cache_queries", "Multimodal processor cache queries, in items."),
        ("mm_cache_hits", "Multimodal processor cache hits, in items."),
        ("prompt_tokens", "Prefill tokens processed."),
        ("generation_tokens", "Generation tokens processed."),
    )

    def __init__(self, model: str, block_size: int, kv_cache_tokens: int) -> None:
        self.labels = f'model_name="{_escape(model)}",engine="0"'
        self.block_size = block_size
        self.kv_cache_tokens = kv_cache_tokens
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.mm_cache_queries = 0
        self.mm_cache_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.aborted = 0
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End to end request latency.", LATENCY_BUCKETS
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds", "Time spent waiting.", LATENCY_BUCKETS
        )

    def success(self, finish_reason: str) -> None:
        self.request_success[finish_reason] = self.request_success.get(finish_reason, 0) + 1

    def render(self, running: int, waiting: int, kv_usage: float) -> bytes:
        labels = self.labels
        out: list[str] = []
        for name, doc in self.COUNTERS:
            full = f"vllm:{name}"
            out += [f"# HELP {full} {doc}", f"# TYPE {full} counter"]
            out.append(f"{full}_total{{{labels}}} {getattr(self, name)}")
        out += [
            "# HELP vllm:request_success Finished requests.",
            "# TYPE vllm:request_success counter",
        ]
        for reason in sorted({"stop", "length", "abort", *self.request_success}):
            count = self.request_success.get(reason, 0)
            out.append(
                f'vllm:request_success_total{{{labels},finished_reason="{_escape(reason)}"}} '
                f"{count}"
            )
        for name, value, doc in (
            ("num_requests_running", running, "Requests in the running batch."),
            ("num_requests_waiting", waiting, "Requests waiting to be scheduled."),
            ("kv_cache_usage_perc", kv_usage, "KV cache usage, 1 means full."),
        ):
            out += [f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} gauge"]
            out.append(f"vllm:{name}{{{labels}}} {value}")
        out += [
            "# HELP vllm:cache_config_info Cache configuration.",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",'
            f'num_gpu_blocks="{self.kv_cache_tokens // self.block_size}",'
            f'enable_prefix_caching="True",engine="0"}} 1.0',
        ]
        for histogram in (self.ttft, self.e2e, self.queue):
            out += histogram.render(labels)
        out += [
            "# HELP sim:received_requests Requests that reached the simulator, by route.",
            "# TYPE sim:received_requests counter",
        ]
        for path, count in sorted(self.received.items()):
            out.append(f'sim:received_requests_total{{path="{_escape(path)}"}} {count}')
        out += [
            "# HELP sim:aborted_requests Requests aborted because the client went away.",
            "# TYPE sim:aborted_requests counter",
            f"sim:aborted_requests_total {self.aborted}",
        ]
        return ("\n".join(out) + "\n").encode()
