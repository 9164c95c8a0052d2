"""Query strings through the gateway under uvicorn, in front of a simulated engine that
records what it receives: a route forwards only the query parameters its table entry
declares, rebuilt from the checked values; anything else is refused before the engine."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import Proc, gateway_proc, running, sim_proc, wait_for

KEY = "key-query-0123456789abcdef"
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
BACKGROUND = ("/health", "/metrics", "/v1/models")


@dataclass
class Stack:
    sim: Proc
    gateway: Proc
    http: httpx.Client

    def send(self, method: str, target: str, body: str | None = None) -> tuple[int, Any]:
        """`target` sent as written (http.client does not normalise it), its answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=10)
        try:
            headers = {"Authorization": f"Bearer {KEY}"}
            if body is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def received(self) -> list[dict[str, Any]]:
        """What the engine received, but for the gateway's own background requests."""
        got = self.http.get(self.sim.url + "/sim/requests").json()
        return [r for r in got if r["path"] not in BACKGROUND]

    def clear(self) -> None:
        self.http.delete(self.sim.url + "/sim/requests")

    def response_id(self) -> str:
        """The id of a response created through the gateway with this key: the request
        id it gave the body (the simulated engine stores no responses)."""
        self.clear()
        self.send("POST", "/v1/responses", json.dumps({"model": MODEL, "input": "hi"}))
        (created,) = self.received()
        rid: str = json.loads(created["body"])["request_id"]
        self.clear()
        return rid


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("query")
    sim = sim_proc(tmp, "--record-requests", "100", "--latency", "zero")
    with running(sim):
        env = {"GATEWAY_ENGINES": json.dumps([sim.url]), "GATEWAY_API_KEYS": json.dumps([KEY])}
        gateway = gateway_proc(tmp, env)
        with running(gateway, ready_path="/healthz"), httpx.Client(timeout=10) as client:
            assert wait_for(lambda: client.get(gateway.url + "/readyz").status_code == 200)
            yield Stack(sim, gateway, client)


def _code(answer: Any) -> str | None:
    return answer.get("error", {}).get("code") if isinstance(answer, dict) else None


@pytest.mark.slow
@pytest.mark.parametrize(
    "query",
    ["?a", "?a#b", "?a=1", "?stream=true", "?%61=1", "?model=other", "?&", "?=x"],
)
def test_a_query_on_a_chat_route_is_refused(stack: Stack, query: str) -> None:
    """Chat declares no query parameter: any query is refused, the engine gets nothing
    (a fragment is never part of the query, so `?a#b` is the query `a`)."""
    stack.clear()
    status, answer = stack.send("POST", "/v1/chat/completions" + query, CHAT)
    assert (status, _code(answer)) == (400, "field_not_allowed")
    assert answer["error"]["param"] == "query"
    assert stack.received() == []


@pytest.mark.slow
def test_declared_parameters_arrive_as_checked(stack: Stack) -> None:
    """`GET /v1/responses/{id}` forwards `stream` and `starting_after`, written again
    from the checked values; an empty `?` is no query at all."""
    cases = [
        ("?stream=TRUE&starting_after=007", "stream=true&starting_after=7"),
        ("?starting_after=0&stream=off", "starting_after=0&stream=false"),
        ("?stream=1", "stream=true"),
        # A fragment never reaches the server: the query is `stream=true`.
        ("?stream=true#x&a=1", "stream=true"),
        ("?starting_after=999999999", "starting_after=999999999"),
        ("?", ""),
        ("", ""),
    ]
    path = "/v1/responses/" + stack.response_id()
    for query, forwarded in cases:
        stack.clear()
        status, _ = stack.send("GET", path + query)
        # The engine (simulated here) stores no responses: its 404 is relayed.
        assert status == 404, query
        got = stack.received()
        assert [(r["method"], r["path"], r["query"]) for r in got] == [("GET", path, forwarded)], (
            query
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("?stream=maybe", "invalid_request"),
        ("?stream=", "invalid_request"),
        ("?stream", "invalid_request"),
        ("?stream=tru%65", "invalid_request"),
        ("?stream=true;x=1", "invalid_request"),
        ("?stream=+true", "invalid_request"),
        ("?starting_after=-1", "invalid_request"),
        ("?starting_after=+3", "invalid_request"),
        ("?starting_after=1e3", "invalid_request"),
        ("?starting_after=1_000", "invalid_request"),
        ("?starting_after=1234567890", "invalid_request"),
        ("?stream=true&stream=false", "invalid_request"),
        ("?starting_after=1&starting_after=2", "invalid_request"),
        ("?%73tream=true", "field_not_allowed"),
        ("?Stream=true", "field_not_allowed"),
        ("?stream=true&", "field_not_allowed"),
        ("?stream=true&a=1", "field_not_allowed"),
    ],
)
def test_bad_parameters_on_the_responses_route_are_refused(
    stack: Stack, query: str, code: str
) -> None:
    path = "/v1/responses/" + stack.response_id()
    status, answer = stack.send("GET", path + query)
    assert (status, _code(answer)) == (400, code)
    assert stack.received() == []


@pytest.mark.slow
def test_the_cancel_route_takes_no_query(stack: Stack) -> None:
    path = f"/v1/responses/{stack.response_id()}/cancel"
    status, answer = stack.send("POST", path + "?stream=true")
    assert (status, _code(answer)) == (400, "field_not_allowed")
    assert stack.received() == []
