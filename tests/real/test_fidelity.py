"""Simulator fidelity: the same requests to `bench.sim` and to a real engine, compared on
what the gateway and its tests rely on: status codes, the error JSON's shape, SSE framing
and the final `data: [DONE]`, the response headers the gateway reads, and metric names.

Every difference that remains is in KNOWN_DIFFERENCES with its reason, and in
docs/sim.md ("Fidelity against the real engine"). A new difference fails this test; so
does a listed one that went away (the list must stay true).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc, running, scrape, sim_proc, wait_for
from tests.real.harness import raw_chat_request

pytestmark = pytest.mark.real_vllm

# (case, property) -> why the simulator differs; kept in step with docs/sim.md.
_FASTAPI = (
    'vLLM answers an unknown route or method with FastAPI\'s own {"detail": ...}; the '
    "simulator uses its error object, which tests/bench/sim/test_sim.py and "
    "tests/bench/sim/test_sim_pooling.py pin (no gateway code reads either body: the "
    "gateway never forwards an unknown route)"
)
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {
    ("unknown path", "json keys"): _FASTAPI,
    ("unknown path", "error"): _FASTAPI,
    ("wrong method", "json keys"): _FASTAPI,
    ("wrong method", "error"): _FASTAPI,
}

# Metrics the gateway and the benchmarks read from an engine.
METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
)


def cases(model: str) -> dict[str, tuple[str, str, Any]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    completion = {"model": model, "prompt": "hello", "max_tokens": 3}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    return {
        "chat": ("POST", "/v1/chat/completions", chat),
        "chat streamed": ("POST", "/v1/chat/completions", {**chat, **usage}),
        "completion": ("POST", "/v1/completions", completion),
        "completion streamed": ("POST", "/v1/completions", {**completion, **usage}),
        "unknown model": ("POST", "/v1/chat/completions", {**chat, "model": "nope"}),
        "invalid JSON": ("POST", "/v1/chat/completions", b"{not json"),
        "no messages": ("POST", "/v1/chat/completions", {"model": model}),
        "too many tokens": ("POST", "/v1/completions", {**completion, "max_tokens": 100000}),
        "unknown path": ("POST", "/v1/nothing", chat),
        "wrong method": ("GET", "/v1/chat/completions", None),
        "tokenize": ("POST", "/tokenize", {"model": model, "prompt": "hello"}),
        "models": ("GET", "/v1/models", None),
        "health": ("GET", "/health", None),
    }


def observe(response: httpx.Response) -> dict[str, Any]:
    """The properties compared, for one response."""
    out: dict[str, Any] = {"status": response.status_code}
    ctype = response.headers.get("content-type", "")
    out["content-type"] = ctype.split(";")[0]
    out["framing"] = (
        "chunked"
        if "chunked" in response.headers.get("transfer-encoding", "")
        else ("content-length" if "content-length" in response.headers else "close")
    )
    body = response.content
    if out["content-type"] == "text/event-stream":
        frames = body.decode().split("\n\n")
        out["sse frames well formed"] = frames[-1] == "" and all(
            f.startswith("data: ") for f in frames[:-1]
        )
        out["last frame"] = frames[-2] if len(frames) > 1 else None
        chunks = [json.loads(f[6:]) for f in frames[:-2]]
        out["chunk object"] = sorted({c["object"] for c in chunks})
        out["final chunk"] = sorted(chunks[-1]) if chunks else None
        out["final chunk has usage, no choices"] = bool(chunks) and (
            chunks[-1].get("usage") is not None and chunks[-1]["choices"] == []
        )
    elif out["content-type"] == "application/json":
        data = response.json()
        out["json keys"] = sorted(data) if isinstance(data, dict) else type(data).__name__
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            error = data["error"]
            out["error"] = (sorted(error), error.get("type"), error.get("code"))
        if isinstance(data, dict) and isinstance(data.get("choices"), list) and data["choices"]:
            out["choice keys"] = sorted(data["choices"][0])
            out["usage keys"] = sorted(data.get("usage") or {})
    else:
        out["body"] = body.decode(errors="replace")[:40]
    return out


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory, real_chat_engine: Engine) -> Iterator[Proc]:
    # The simulator configured like the engine: its model id, length and block size.
    proc = sim_proc(
        tmp_path_factory.mktemp("fidelity"), "--latency", "zero", "--model",
        real_chat_engine.name, "--max-model-len", "2048", "--block-size", "128",
    )  # fmt: skip
    with running(proc):
        yield proc


def send(base: str, method: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return HTTP.request(method, base + path, content=body, headers=headers, timeout=30)
    return HTTP.request(method, base + path, json=body, timeout=30)


def differences(sim: Proc, engine: Engine) -> dict[tuple[str, str], tuple[Any, Any]]:
    found = {}
    for case, (method, path, body) in cases(engine.name).items():
        real = observe(send(engine.url, method, path, body))
        simulated = observe(send(sim.url, method, path, body))
        for prop in sorted(set(real) | set(simulated)):
            if real.get(prop) != simulated.get(prop):
                found[(case, prop)] = (real.get(prop), simulated.get(prop))
    real_metrics = {name for name, _ in scrape(engine.url + "/metrics")}
    sim_metrics = {name for name, _ in scrape(sim.url + "/metrics")}
    for name in METRICS:
        if (name in real_metrics) != (name in sim_metrics):
            found[("metrics", name)] = (name in real_metrics, name in sim_metrics)
    return found


def test_sim_answers_like_the_real_engine(sim: Proc, real_chat_engine: Engine) -> None:
    found = differences(sim, real_chat_engine)
    report = "\n".join(f"{k}: real {v[0]!r}, sim {v[1]!r}" for k, v in sorted(found.items()))
    print(report)
    assert set(found) == set(KNOWN_DIFFERENCES), report


def test_metrics_the_gateway_reads_exist_on_the_real_engine(real_chat_engine: Engine) -> None:
    names = {name for name, _ in scrape(real_chat_engine.url + "/metrics")}
    assert set(METRICS) <= names


def abort_counted(url: str, port: int, model: str) -> bool:
    """Whether a client that leaves mid-request moves
    `vllm:request_success_total{finished_reason="abort"}`."""

    def sample(name: str, **labels: str) -> float:
        return sum(
            v
            for (n, ls), v in scrape(url + "/metrics").items()
            if n == name and labels.items() <= dict(ls).items()
        )

    before = sample("vllm:request_success_total", finished_reason="abort")
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count the trees."}],
        "max_tokens": 1900,
        "ignore_eos": True,
    }
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(raw_chat_request(body))
        assert wait_for(lambda: sample("vllm:num_requests_running") == 1, timeout=10)
    assert wait_for(lambda: sample("vllm:num_requests_running") == 0, timeout=10)
    time.sleep(0.5)
    return sample("vllm:request_success_total", finished_reason="abort") > before


def test_client_abort_accounting_differs_as_documented(
    tmp_path_factory: pytest.TempPathFactory, real_chat_engine: Engine
) -> None:
    # vLLM 0.32 aborts a client's request in the API server and records no finished
    # request; the simulator counts it under finished_reason="abort" (docs/sim.md, and
    # tests/bench/sim/test_sim_latency.py pins it). The gateway reads neither.
    proc = sim_proc(tmp_path_factory.mktemp("fidelity-abort"), "--model", real_chat_engine.name)
    with running(proc):
        assert abort_counted(proc.url, proc.port, real_chat_engine.name) is True
    engine = real_chat_engine
    assert abort_counted(engine.url, engine.port, engine.name) is False
