"""`GET /v1/models` through the gateway: a key limited to some models sees only those.

Real processes on loopback: a simulated engine serving two model names, and an engine
stand-in whose model list cannot be read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.origin import RecordingServer, Route
from tests.procs import Proc, gateway_proc, running, sim_proc

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


def _env(engine: str) -> dict[str, str]:
    return {"GATEWAY_ENGINES": json.dumps([engine]), "GATEWAY_API_KEYS": KEYS}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("models")
    sim = sim_proc(
        tmp, "--latency", "zero", "--served-model-name", "model-a", "model-b",
        "--enable-runtime-lora",
    )  # fmt: skip
    gateway = gateway_proc(tmp, _env(sim.url))
    # Answers its model list with something that is not one.
    garbage = Route(
        body=b'{"object": "list", "data": "nope"}', headers={"Content-Type": "application/json"}
    )
    with RecordingServer({"/v1/models": garbage, "/health": Route()}) as broken:
        broken_gateway = gateway_proc(tmp, _env(broken.url))
        with running(sim), running(gateway, broken_gateway, ready_path="/healthz"):
            yield Stack(sim, gateway, broken, broken_gateway)


def _models(url: str, key: str) -> httpx.Response:
    return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def _ids(resp: httpx.Response) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [m["id"] for m in resp.json()["data"]]


def test_a_key_without_a_model_list_sees_every_model(stack: Stack) -> None:
    direct = httpx.get(stack.sim.url + "/v1/models", timeout=10).json()
    assert _ids(_models(stack.gateway.url, ALL)) == [m["id"] for m in direct["data"]]
    assert _ids(_models(stack.gateway.url, ALL)) == ["model-a", "model-b"]


def test_model_roots_never_show_the_engines_paths(stack: Stack) -> None:
    """vLLM lists a model's (or adapter's) path on its disk as `root`."""
    direct = httpx.get(stack.sim.url + "/v1/models", timeout=10).json()
    assert {m["root"] for m in direct["data"]} == {"Qwen/Qwen3-VL-2B-Instruct"}
    for key in (ALL, ONLY_A):
        for model in _models(stack.gateway.url, key).json()["data"]:
            assert model["root"] == model["id"]


def test_a_key_limited_to_some_models_sees_only_those(stack: Stack) -> None:
    resp = _models(stack.gateway.url, ONLY_A)
    assert _ids(resp) == ["model-a"]
    # The rest of the engine's answer is kept; the length is the filtered body's.
    assert resp.json()["object"] == "list"
    assert resp.json()["data"][0]["owned_by"] == "vllm"
    assert int(resp.headers["content-length"]) == len(resp.content)
    assert _ids(_models(stack.gateway.url, NOT_SERVED)) == []


def test_an_unreadable_model_list_is_refused(stack: Stack) -> None:
    before = len(stack.broken.hits)
    resp = _models(stack.broken_gateway.url, ONLY_A)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_invalid"
    assert "nope" not in resp.text
    # It did ask the engine (and only that): the refusal is about the answer.
    assert [h.path for h in stack.broken.hits[before:]] == ["/v1/models"]
    # A key without a model list is refused the same: the list is always rewritten.
    passed = _models(stack.broken_gateway.url, ALL)
    assert passed.status_code == 502 and passed.json()["error"]["code"] == "upstream_invalid"


def test_an_adapters_base_model_and_path_are_shown_only_as_far_as_the_key_may_see(
    stack: Stack,
) -> None:
    """vLLM lists a LoRA adapter with its path as `root` and its base model as `parent`."""
    load = {"lora_name": "adapter-x", "lora_path": "/srv/adapters/secret-x"}
    assert httpx.post(stack.sim.url + "/v1/load_lora_adapter", json=load).status_code == 200
    try:
        direct = httpx.get(stack.sim.url + "/v1/models", timeout=10).json()["data"]
        assert {m["id"]: (m["root"], m["parent"]) for m in direct if m["id"] == "adapter-x"} == {
            "adapter-x": ("/srv/adapters/secret-x", "model-a")
        }
        limited = _models(stack.gateway.url, ADAPTER)
        assert limited.json()["data"] == [
            {**next(m for m in direct if m["id"] == "adapter-x"),
             "root": "adapter-x", "parent": None}
        ]  # fmt: skip
        assert "secret-x" not in limited.text and "model-a" not in limited.text
        # A key that may use the base model sees which model the adapter is for.
        every = {m["id"]: m for m in _models(stack.gateway.url, ALL).json()["data"]}
        assert every["adapter-x"]["parent"] == "model-a"
        assert every["adapter-x"]["root"] == "adapter-x"
    finally:
        httpx.post(stack.sim.url + "/v1/unload_lora_adapter", json={"lora_name": "adapter-x"})
