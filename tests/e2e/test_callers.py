"""Who is calling, through real processes on loopback: the gateway under uvicorn in front
of a simulated engine, called from several loopback source addresses (127.0.0.2, .3 ...,
all of them this machine's).

Gateway D trusts no proxy: the client is the TCP peer and X-Forwarded-For is ignored.
Gateway T trusts 127.0.0.1/32, the "proxy": from it, X-Forwarded-For names the client.
Both throttle failed authentications past `AUTH_FAILURES` in a window long enough that
no test run crosses its end (windows are aligned to the epoch: one ends every ~11 days).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    error_code,
    gateway_proc,
    running,
    scrape,
    sim_proc,
    sim_received,
    total,
)

GOOD = "sk-callers-good-0123456789abcdef"
SPARE = "sk-callers-spare-0123456789abcdef"
METRICS = "sk-callers-metrics-0123456789abcdef"
WRONG = "sk-callers-wrong-0123456789abcdef"
AUTH_FAILURES = 5
WINDOW = 1_000_000
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Stack:
    sim: Proc
    direct: Proc
    trusting: Proc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("callers")
    sim = sim_proc(tmp, "--latency", "zero")
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(
            [
                {"key": GOOD, "name": "good"},
                {"key": SPARE, "name": "spare"},
                {"key": METRICS, "name": "metrics", "scopes": ["metrics"]},
            ]
        ),
        "GATEWAY_LIMITS__AUTH_FAILURES": str(AUTH_FAILURES),
        "GATEWAY_LIMITS__AUTH_FAILURE_WINDOW": str(WINDOW),
    }
    direct = gateway_proc(tmp, env)
    trusting = gateway_proc(tmp, {**env, "GATEWAY_TRUSTED_PROXIES": '["127.0.0.1/32"]'})
    with running(sim, ready_path="/health"), running(direct, trusting, ready_path="/readyz"):
        yield Stack(sim, direct, trusting)


def client_from(address: str, gateway: Proc) -> httpx.Client:
    """A client whose connections leave from `address`."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=gateway.url, transport=transport, timeout=10)


def chat(client: httpx.Client, key: str | None, **headers: str) -> httpx.Response:
    sent = {**(auth(key) if key is not None else {}), **headers}
    return client.post("/v1/chat/completions", headers=sent, json=CHAT)


def request_lines(gateway: Proc) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "request"]


def throttled_lines(gateway: Proc) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "auth_throttled"]


def test_a_flood_of_wrong_keys_from_one_address_is_throttled(stack: Stack) -> None:
    gw = stack.direct
    with client_from("127.0.0.2", gw) as flooder, client_from("127.0.0.3", gw) as other:
        # The flooding address's own client, working before the flood starts.
        assert chat(flooder, GOOD).status_code == 200
        received = sim_received(stack.sim.url)
        answers = [chat(flooder, WRONG) for _ in range(AUTH_FAILURES)]
        answers += [chat(flooder, WRONG), chat(flooder, None), chat(flooder, SPARE)]
        codes = [(r.status_code, error_code(r)) for r in answers]
        assert (
            codes == [(401, "invalid_api_key")] * AUTH_FAILURES + [(429, "too_many_failures")] * 3
        )
        for r in answers[AUTH_FAILURES:]:
            assert 1 <= int(r.headers["retry-after"]) <= WINDOW
            assert "www-authenticate" not in r.headers
        # A valid key never used from the throttled address gets the wrong key's answer:
        # the address learns nothing about the keys it tries.
        assert answers[-1].json() == answers[-3].json()
        # Nothing of the flood reached the engine.
        assert sim_received(stack.sim.url) == received
        # The address's own key, used from there before, still goes on.
        assert chat(flooder, GOOD).status_code == 200
        # Another address is not throttled, its good key nor its mistakes.
        assert chat(other, GOOD).status_code == 200
        assert chat(other, SPARE).status_code == 200
        r = chat(other, WRONG)
        assert (r.status_code, error_code(r)) == (401, "invalid_api_key")
        assert sim_received(stack.sim.url) == received + 3

    (line,) = [line for line in throttled_lines(gw) if line["client"] == "127.0.0.2"]
    assert line["failures"] == AUTH_FAILURES
    for secret in (GOOD, SPARE, WRONG):
        assert secret not in gw.log()
    samples = scrape(gw.url + "/metrics", headers=auth(METRICS))
    failures = "gateway_auth_failures_total"
    # The flooder's failures within the limit, and the other address's one.
    assert total(samples, failures, result="counted") == AUTH_FAILURES + 1
    assert total(samples, failures, result="throttled") == 3
    assert total(samples, "gateway_requests_total", code="too_many_failures") == 3


def test_the_log_line_names_the_peer_and_ignores_forwarded_for(stack: Stack) -> None:
    with client_from("127.0.0.4", stack.direct) as client:
        r = chat(client, GOOD, **{"X-Request-Id": "callers-peer", "X-Forwarded-For": "192.0.2.1"})
        assert r.status_code == 200
    (line,) = [x for x in request_lines(stack.direct) if x["request_id"] == "callers-peer"]
    assert line["client"] == "127.0.0.4"
    keys = list(line)
    assert keys[keys.index("key_name") + 1] == "client"


def test_forwarded_clients_behind_a_trusted_proxy(stack: Stack) -> None:
    gw = stack.trusting
    received = sim_received(stack.sim.url)
    with client_from("127.0.0.1", gw) as proxy, client_from("127.0.0.6", gw) as outsider:
        # Through the proxy: each forwarded client is counted apart.
        first = {"X-Forwarded-For": "198.51.100.1, 127.0.0.1"}
        second = {"X-Forwarded-For": "198.51.100.2"}
        answers = [chat(proxy, WRONG, **first) for _ in range(AUTH_FAILURES + 1)]
        assert [r.status_code for r in answers] == [401] * AUTH_FAILURES + [429]
        assert error_code(answers[-1]) == "too_many_failures"
        r = chat(proxy, WRONG, **second)
        assert (r.status_code, error_code(r)) == (401, "invalid_api_key")
        r = chat(proxy, GOOD, **{**second, "X-Request-Id": "callers-forwarded"})
        assert r.status_code == 200
        # Neither the proxy's own address nor an untrusted peer naming the throttled
        # client is throttled: the header is believed only from the proxy.
        assert chat(proxy, GOOD).status_code == 200
        r = chat(outsider, WRONG, **{**first, "X-Request-Id": "callers-outsider"})
        assert (r.status_code, error_code(r)) == (401, "invalid_api_key")
    assert sim_received(stack.sim.url) == received + 2

    lines = {line["request_id"]: line for line in request_lines(gw)}
    assert lines["callers-forwarded"]["client"] == "198.51.100.2"
    assert lines["callers-outsider"]["client"] == "127.0.0.6"
    (line,) = throttled_lines(gw)
    assert line["client"] == "198.51.100.1"
