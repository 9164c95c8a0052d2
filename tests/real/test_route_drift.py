"""Route drift: every route a real engine serves must be classified by the gateway's
endpoint table (forwarded, blocked or local), never left `unknown`. An upgrade of vLLM
that adds a route fails here, naming it."""

from __future__ import annotations

import pytest

from bench.harness.realvllm.launcher import Engine
from tests.real.harness import engine_routes, unclassified

pytestmark = pytest.mark.real_vllm


def test_generative_engine_routes_are_all_classified(real_chat_engine: Engine) -> None:
    routes = engine_routes(real_chat_engine)
    # The reading itself works: the routes the tier relies on are there.
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/invocations"} <= set(routes)
    assert unclassified(real_chat_engine) == []


def test_multimodal_engine_routes_are_all_classified(real_multimodal_engine: Engine) -> None:
    assert "/v1/chat/completions" in engine_routes(real_multimodal_engine)
    assert unclassified(real_multimodal_engine) == []
