"""What the gateway reads of a real engine's /metrics for placement (engine_load.py): its
prefix cache's queries less its hits are the prompt tokens it recomputed, so a fresh
prompt adds all its tokens and the same prompt again only what its full KV blocks do not
hold (the CPU backend's blocks are 128 tokens; the prompt's last token is never taken
from the cache)."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from bench.harness.realvllm.launcher import Engine
from bench.harness.realvllm.models import WORDS
from gateway.routing.engine_load import parse_load

pytestmark = pytest.mark.real_vllm

BLOCK = 128


def _recomputed(engine: Engine) -> float:
    load = parse_load(httpx.get(engine.url + "/metrics", timeout=10).content)
    assert load is not None and load.recomputed is not None
    return load.recomputed


def _settled(engine: Engine, before: float) -> float:
    """The counter once it has moved past `before` and held still for a moment (vLLM
    records its stats as the engine steps)."""
    deadline = time.monotonic() + 20
    last = _recomputed(engine)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _recomputed(engine)
        if now == last and now > before:
            return now
        last = now
    return last


def test_recomputed_tokens_are_the_prompt_tokens_the_cache_did_not_hold(
    real_chat_engine: Engine,
) -> None:
    rng = random.Random(31)
    prompt = " ".join(rng.choice(WORDS) for _ in range(700))
    body = {"model": real_chat_engine.name, "prompt": prompt, "max_tokens": 1}
    url = real_chat_engine.url + "/v1/completions"
    start = _recomputed(real_chat_engine)

    first = httpx.post(url, json=body, timeout=120)
    assert first.status_code == 200, first.text
    tokens = first.json()["usage"]["prompt_tokens"]
    assert tokens > 2 * BLOCK
    after_first = _settled(real_chat_engine, start)
    assert after_first - start == tokens

    second = httpx.post(url, json=body, timeout=120)
    assert second.status_code == 200, second.text
    after_second = _settled(real_chat_engine, after_first)
    cached = (tokens - 1) // BLOCK * BLOCK
    assert after_second - after_first == tokens - cached
