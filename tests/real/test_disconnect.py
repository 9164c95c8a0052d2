"""A client that leaves mid-request, streamed or not: vLLM itself must count the request
as aborted (`vllm:request_success_total{finished_reason="abort"}`), which happens only
when the gateway closes its upstream connection (VLLM-FACTS.md, "Disconnect")."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from bench.realvllm.launcher import Engine
from tests.procs import Proc, wait_for
from tests.real.harness import AUTH, chat_body, gateway, metric

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def chat_gw(tmp_path_factory: pytest.TempPathFactory, real_chat_engine: Engine) -> Iterator[Proc]:
    with gateway(tmp_path_factory.mktemp("disconnect"), [real_chat_engine]) as proc:
        yield proc


def aborted(engine: Engine) -> float:
    return metric(engine, "vllm:request_success_total", finished_reason="abort")


def running(engine: Engine) -> float:
    return metric(engine, "vllm:num_requests_running")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
def test_client_disconnect_is_an_abort_in_vllm(
    chat_gw: Proc, real_chat_engine: Engine, stream: bool
) -> None:
    engine = real_chat_engine
    assert wait_for(lambda: running(engine) == 0, timeout=30)
    before = aborted(engine)
    # Long enough to be running when the client leaves: 1,900 tokens, end of text ignored.
    body = chat_body(engine.name, "Count the trees.", max_tokens=1900, ignore_eos=True)
    with httpx.Client(base_url=chat_gw.url, headers=AUTH, timeout=60) as client:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_raw())
                # The gauge follows the engine's steps: give it one.
                assert wait_for(lambda: running(engine) == 1, timeout=5)
        else:
            # A raw connection: the request is sent, no answer read, the socket closed
            # once the engine is at work on it.
            payload = json.dumps(body).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: {AUTH['Authorization']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
            )
            with socket.create_connection(("127.0.0.1", chat_gw.port)) as conn:
                conn.sendall(head.encode() + payload)
                assert wait_for(lambda: running(engine) == 1, timeout=10)
    # The client is gone: vLLM aborts the request and frees its slot.
    assert wait_for(lambda: aborted(engine) == before + 1, timeout=15)
    assert wait_for(lambda: running(engine) == 0, timeout=15)
