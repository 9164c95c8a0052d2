"""`GET /v1/models` through the gateway: answered from the engines' lists as the gateway
last read them; a key limited to some models sees only those.

Real processes on loopback: a simulated engine serving two model names (its gateway
reads the list again every 0.3 s), and an engine stand-in whose model list cannot be
read. Engines serving different models: tests/e2e/test_model_pools.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.origin import RecordingServer, Route
from tests.procs import Proc, error_code, gateway_proc, running, scrape, sim_proc, wait_for

ALL = "sk-models-all-0123456789abcdef"
ONLY_A = "sk-models-only-a-0123456789abcdef"
NOT_SERVED = "sk-models-none-0123456789abcdef"
ADAPTER = "sk-models-adapter-0123456789abcdef"
KEYS = json.dumps(
    [
        ALL,
        {"key": ONLY_A, "name": "only-a", "models": ["model-a"]},
        {"key": NOT_SERVED, "name": "not-served", "models": ["some/other-model"]},
        {"key": ADAPTER, "name": "adapter-only", "models": ["adapter-x"]},
    ]
)


@dataclass
class Stack:
    sim: Proc
    gateway: Proc
    broken: RecordingServer
    broken_gateway: Proc
    quiet: Proc
    quiet_sim: Proc


def _env(engine: str, health_interval: str = "0.2") -> dict[str, str]:
    return {
        "GATEWAY_ENGINES": json.dumps([engine]),
        "GATEWAY_API_KEYS": KEYS,
        "GATEWAY_ROUTING__HEALTH_INTERVAL": health_interval,
        "GATEWAY_ROUTING__MODELS_INTERVAL": "0.3",
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("models")
    sim = sim_proc(
        tmp, "--latency", "zero", "--served-model-name", "model-a", "model-b",
        "--enable-runtime-lora",
    )  # fmt: skip
    gateway = gateway_proc(tmp, _env(sim.url))
    # A gateway that checks its own engine only at start (and then every 10 minutes).
    quiet_sim = sim_proc(tmp, "--latency", "zero", "--served-model-name", "model-q")
    quiet = gateway_proc(tmp, _env(quiet_sim.url, "600"))
    # Answers its model list with something that is not one.
    garbage = Route(
        body=b'{"object": "list", "data": "nope"}', headers={"Content-Type": "application/json"}
    )
    with RecordingServer({"/v1/models": garbage, "/health": Route()}) as broken:
        broken_gateway = gateway_proc(tmp, _env(broken.url))
        gateways = (gateway, quiet, broken_gateway)
        with running(sim, quiet_sim), running(*gateways, ready_path="/healthz"):
            assert wait_for(lambda: HTTP.get(quiet.url + "/readyz").status_code == 200)
            yield Stack(sim, gateway, broken, broken_gateway, quiet, quiet_sim)


def _models(url: str, key: str) -> httpx.Response:
    return HTTP.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def _ids(resp: httpx.Response) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [m["id"] for m in resp.json()["data"]]


@pytest.mark.slow
def test_a_key_without_a_model_list_sees_every_model(stack: Stack) -> None:
    direct = HTTP.get(stack.sim.url + "/v1/models", timeout=10).json()
    assert _ids(_models(stack.gateway.url, ALL)) == [m["id"] for m in direct["data"]]
    assert _ids(_models(stack.gateway.url, ALL)) == ["model-a", "model-b"]


@pytest.mark.slow
def test_model_roots_never_show_the_engines_paths(stack: Stack) -> None:
    """vLLM lists a model's (or adapter's) path on its disk as `root`."""
    direct = HTTP.get(stack.sim.url + "/v1/models", timeout=10).json()
    assert {m["root"] for m in direct["data"]} == {"Qwen/Qwen3-VL-2B-Instruct"}
    for key in (ALL, ONLY_A):
        for model in _models(stack.gateway.url, key).json()["data"]:
            assert model["root"] == model["id"]


@pytest.mark.slow
def test_a_key_limited_to_some_models_sees_only_those(stack: Stack) -> None:
    resp = _models(stack.gateway.url, ONLY_A)
    assert _ids(resp) == ["model-a"]
    # The rest of the engine's entry is kept; the length is the filtered body's.
    assert resp.json()["object"] == "list"
    assert resp.json()["data"][0]["owned_by"] == "vllm"
    assert int(resp.headers["content-length"]) == len(resp.content)
    assert _ids(_models(stack.gateway.url, NOT_SERVED)) == []


def _model_list_reads(sim: Proc) -> float:
    return sum(
        v
        for (name, labels), v in scrape(sim.url + "/metrics").items()
        if name == "sim:received_requests_total" and dict(labels)["path"] == "/v1/models"
    )


@pytest.mark.slow
def test_the_list_is_the_gateways_own_copy(stack: Stack) -> None:
    # The quiet gateway reads its engine's list at its checks only (at start): twenty
    # calls, and the engine is not asked once.
    before = _model_list_reads(stack.quiet_sim)
    assert before == 1
    for _ in range(20):
        assert _ids(_models(stack.quiet.url, ALL)) == ["model-q"]
    assert _model_list_reads(stack.quiet_sim) == before


@pytest.mark.slow
def test_an_engine_whose_model_list_cannot_be_read_never_serves(stack: Stack) -> None:
    # Its models unknown, the engine is not healthy: nothing is forwarded to it, and
    # the answers say "retry shortly", never the engine's text.
    assert HTTP.get(stack.broken_gateway.url + "/readyz").status_code == 503
    before = len(stack.broken.hits)
    for key in (ONLY_A, ALL):
        resp = _models(stack.broken_gateway.url, key)
        assert (resp.status_code, error_code(resp)) == (503, "no_engine_available")
        assert "nope" not in resp.text
    chat = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}
    resp = HTTP.post(
        stack.broken_gateway.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {ALL}"},
        json=chat,
        timeout=10,
    )
    assert (resp.status_code, error_code(resp)) == (503, "no_engine_available")
    assert {h.path for h in stack.broken.hits[before:]} <= {"/health", "/v1/models"}


@pytest.mark.slow
def test_an_adapters_base_model_and_path_are_shown_only_as_far_as_the_key_may_see(
    stack: Stack,
) -> None:
    """vLLM lists a LoRA adapter with its path as `root` and its base model as `parent`."""
    load = {"lora_name": "adapter-x", "lora_path": "/srv/adapters/secret-x"}
    assert HTTP.post(stack.sim.url + "/v1/load_lora_adapter", json=load).status_code == 200
    try:
        direct = HTTP.get(stack.sim.url + "/v1/models", timeout=10).json()["data"]
        assert {m["id"]: (m["root"], m["parent"]) for m in direct if m["id"] == "adapter-x"} == {
            "adapter-x": ("/srv/adapters/secret-x", "model-a")
        }
        # Learnt at the gateway's next read of the engine's list.
        assert wait_for(lambda: _ids(_models(stack.gateway.url, ADAPTER)) == ["adapter-x"])
        limited = _models(stack.gateway.url, ADAPTER)
        # `created` is the time of the gateway's read of the list.
        unstamped = {k: v for k, v in limited.json()["data"][0].items() if k != "created"}
        adapter = next(m for m in direct if m["id"] == "adapter-x")
        assert unstamped == {
            **{k: v for k, v in adapter.items() if k != "created"},
            "root": "adapter-x",
            "parent": None,
        }
        assert "secret-x" not in limited.text and "model-a" not in limited.text
        # A key that may use the base model sees which model the adapter is for.
        every = {m["id"]: m for m in _models(stack.gateway.url, ALL).json()["data"]}
        assert every["adapter-x"]["parent"] == "model-a"
        assert every["adapter-x"]["root"] == "adapter-x"
    finally:
        HTTP.post(stack.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "adapter-x"})
    assert wait_for(lambda: _ids(_models(stack.gateway.url, ADAPTER)) == [])


@pytest.mark.slow
def test_an_entry_whose_parent_is_not_a_name_is_left_out(tmp_path: Path) -> None:
    """vLLM's `parent` is a model name or null. An engine listing an entry with a list
    (unhashable) as its parent once failed every rebuild of the index: start-up failed,
    and compiled (scripts/compile.py) the worker died of a segmentation fault logging it."""
    listing = {
        "object": "list",
        "data": [
            {"id": "model-a", "object": "model", "parent": None},
            {"id": "odd-adapter", "object": "model", "parent": ["model-a"]},
            {"id": "odd-too", "object": "model", "parent": {"id": "model-a"}},
        ],
    }
    models = Route(body=json.dumps(listing).encode(), headers={"Content-Type": "application/json"})
    with RecordingServer({"/v1/models": models, "/health": Route()}) as engine:
        gateway = gateway_proc(tmp_path, _env(engine.url))
        with running(gateway, ready_path="/readyz"):
            resp = _models(gateway.url, ALL)
            assert resp.status_code == 200, resp.text
            assert _ids(resp) == ["model-a"]
            chat = {"model": "odd-adapter", "messages": [{"role": "user", "content": "hi"}]}
            refused = HTTP.post(
                gateway.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {ALL}"},
                json=chat,
                timeout=10,
            )
            assert (refused.status_code, error_code(refused)) == (404, "model_not_found")
            # Its checks, model reads and load scrapes only: the chat went nowhere.
            assert {h.path for h in engine.hits} <= {"/health", "/v1/models", "/metrics"}
            assert gateway.popen is not None and gateway.popen.poll() is None
