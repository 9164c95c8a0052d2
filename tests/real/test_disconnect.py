"""A client that leaves a stream must end the request inside vLLM: the gateway closes
its upstream connection (after `timeouts.left_grace`, read for the engine's counts), and
vLLM aborts only then (docs/vllm.md, "Wire details"). A non-streamed request whose
client leaves before its answer starts runs to its end instead, to be metered
(docs/gateway.md, "A client that leaves").

How vLLM 0.32 shows a client abort in its own metrics: the API server aborts the request
(`OutputProcessor.abort_requests`) without recording it as finished, so no
`vllm:request_success_total` of any `finished_reason` moves (its `abort` label counts only
aborts from inside the engine core); the request leaves `vllm:num_requests_running`, and
`vllm:generation_tokens_total` stops far short of `max_tokens`. A request the gateway
failed to cancel would instead run to `max_tokens` and count as finished (`length`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc, wait_for
from tests.real.harness import AUTH, Snapshot, chat_body, gateway, raw_chat_request

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 1900  # ~5 s on this machine; the model's context is 2,048


def long_request(engine: Engine) -> tuple[Snapshot, dict[str, object], Callable[[], bool]]:
    """Once `engine` is idle: its counters, a chat asking for MAX_TOKENS tokens, and
    whether the engine is at work on a request of its own since then."""
    assert wait_for(lambda: Snapshot.of(engine).running == 0, timeout=30)
    before = Snapshot.of(engine)
    body = chat_body(engine.name, "Count the trees.", max_tokens=MAX_TOKENS, ignore_eos=True)

    def at_work() -> bool:
        now = Snapshot.of(engine)
        return now.running == 1 and now.generated > before.generated

    return before, body, at_work


@pytest.fixture(scope="module")
def chat_gw(tmp_path_factory: pytest.TempPathFactory, real_chat_engine: Engine) -> Iterator[Proc]:
    with gateway(tmp_path_factory.mktemp("disconnect"), [real_chat_engine]) as proc:
        yield proc


def test_client_disconnect_aborts_the_request_in_vllm(
    chat_gw: Proc, real_chat_engine: Engine
) -> None:
    engine = real_chat_engine
    before, body, at_work = long_request(engine)

    with (
        httpx.Client(base_url=chat_gw.url, headers=AUTH, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        # Keep the iterator: a discarded one is closed, and the response with it.
        chunks = r.iter_raw()
        next(chunks)
        assert wait_for(at_work, timeout=10), Snapshot.of(engine)
    # The client is gone: the request leaves the running set after the grace...
    assert wait_for(lambda: Snapshot.of(engine).running == 0, timeout=5), Snapshot.of(engine)
    time.sleep(1)
    after = Snapshot.of(engine)
    # ...unfinished: not counted as finished, far fewer tokens than asked for, no more coming.
    assert after.finished == before.finished, after
    assert 0 < after.generated - before.generated < MAX_TOKENS / 2, after
    assert Snapshot.of(engine).generated == after.generated


def test_a_request_left_before_its_answer_runs_to_its_end(
    chat_gw: Proc, real_chat_engine: Engine
) -> None:
    # A raw connection: the request sent, no answer read, the socket closed while the
    # engine is at work on it. The engine's request is not closed: vLLM finishes it.
    engine = real_chat_engine
    before, body, at_work = long_request(engine)

    with socket.create_connection(("127.0.0.1", chat_gw.port)) as conn:
        conn.sendall(raw_chat_request(body, AUTH))
        assert wait_for(at_work, timeout=10), Snapshot.of(engine)
    assert wait_for(lambda: Snapshot.of(engine).running == 0, timeout=60), Snapshot.of(engine)
    after = Snapshot.of(engine)
    assert after.finished == before.finished + 1, after
    assert after.generated - before.generated == MAX_TOKENS, after
