"""Each middleware of gateway/middleware.py called in-process, as tables of small cases:
the status and error code a request gets, and whether it reached the app inside.

The stack is built as app.py builds it, outermost first, down to the middleware under
test, with a tiny app inside that records what reached it. The same refusals through
real processes are in test_gateway.py and test_endpoints.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.access.admission import Admission
from gateway.access.api_keys import KeyRing
from gateway.config.key_file import ApiKeyConfig, RateLimit, build_keys
from gateway.config.settings import LimitsSettings
from gateway.errors import InvalidJson
from gateway.exchange import exchange_of
from gateway.middleware import Front
from gateway.observability.logging import RequestLog
from gateway.observability.metrics import Metrics
from gateway.proxy.body import ClientDisconnected
from gateway.types import ASGIApp, Message, Receive, Scope, Send

FULL = "sk-middleware-full-0123456789"
POOLING = "sk-middleware-pooling-0123456789"
INFERENCE = "sk-middleware-inference-0123456789"
BOTH = "sk-middleware-both-0123456789"
METRICS = "sk-middleware-metrics-0123456789"
WRONG = "sk-middleware-not-configured-0123456789"
OWN_CAP = "sk-middleware-own-cap-0123456789"
OWN_RATE = "sk-middleware-own-rate-0123456789"
KEYS = build_keys(
    [
        ApiKeyConfig(key=FULL, name="full"),
        ApiKeyConfig(key=POOLING, name="pooling", scopes=["pooling"]),
        ApiKeyConfig(key=INFERENCE, name="inference", scopes=["inference"]),
        ApiKeyConfig(key=BOTH, name="both", scopes=["inference", "pooling"]),
        ApiKeyConfig(key=METRICS, name="metrics", scopes=["metrics"]),
        ApiKeyConfig(key=OWN_CAP, name="own-cap", max_in_flight=1),
        ApiKeyConfig(key=OWN_RATE, name="own-rate", rate=RateLimit(requests_per_second=1)),
    ]
)


class Logger:
    """Records what the middleware logs: the request line (console format goes through
    `info`) and unhandled errors."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []
        self.exceptions: list[str] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})

    def exception(self, event: str, **fields: Any) -> None:
        self.exceptions.append(event)


@dataclass
class Inner:
    """The app inside the stack: answers 200 `ok`, or runs `behaviour` instead."""

    scopes: list[Scope] = field(default_factory=list)
    behaviour: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)
        if self.behaviour is not None:
            await self.behaviour(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@dataclass
class Answer:
    status: int | None
    headers: dict[bytes, bytes]
    body: bytes

    @property
    def code(self) -> str | None:
        if self.status is None or self.status < 400:
            return None
        code: str = orjson.loads(self.body)["error"]["code"]
        return code


@dataclass
class Stack:
    app: ASGIApp
    inner: Inner
    logger: Logger
    metrics: Metrics
    admission: Admission
    clock: list[float]


def stack(
    *,
    public_metrics: bool = False,
    allow_unauthenticated: bool = False,
    max_headers: int = 64,
    per_key: int = 8,
    rate: RateLimit | None = None,
) -> Stack:
    """The gateway's `Front` with `Inner` as every handler; the admission's clock is
    `Stack.clock[0]`, moved by hand."""
    inner, logger, metrics = Inner(), Logger(), Metrics()
    keyring = KeyRing(KEYS, allow_unauthenticated=allow_unauthenticated)
    clock = [1000.0]
    limits = LimitsSettings(max_in_flight_per_key=per_key, rate_per_key=rate)
    admission = Admission(limits, metrics, clock=lambda: clock[0])
    context = Front(
        proxy=inner,
        local=inner,
        models=inner,
        metrics=metrics,
        logger=logger,
        request_log=RequestLog(logger, fmt="console", level="info"),
        max_headers=max_headers,
        keyring=keyring,
        admission=admission,
        public_metrics=public_metrics,
    )
    return Stack(context, inner, logger, metrics, admission, clock)


def scope(
    path: str = "/v1/chat/completions",
    method: str = "POST",
    key: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    raw_path: bytes | None = None,
) -> Scope:
    raw_headers = list(headers or [])
    if key is not None:
        raw_headers.append((b"authorization", b"Bearer " + key.encode()))
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": raw_path if raw_path is not None else path.encode(),
        "query_string": b"",
        "headers": raw_headers,
    }


async def call(app: ASGIApp, request: Scope) -> Answer:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(request, receive, send)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) <= 1, sent
    if not starts:
        return Answer(None, {}, b"")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Answer(starts[0]["status"], dict(starts[0]["headers"]), body)


def samples(metrics: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


# --- The endpoint table -----------------------------------------------


@pytest.mark.parametrize(
    ("path", "method", "raw_path", "status", "code"),
    [
        ("/v1/chat/completions", "POST", None, 200, None),
        ("/v1/chat/completions", "GET", None, 405, "method_not_allowed"),
        ("/v1/models", "POST", None, 405, "method_not_allowed"),
        ("/v1/load_lora_adapter", "POST", None, 403, "endpoint_blocked"),
        # A blocked route in another spelling stays blocked, never unknown or forwarded.
        ("/v1/load_lora_adapter", "POST", b"/v1/./load_lora_adapter", 403, "endpoint_blocked"),
        ("/v1/load_lora_adapter", "POST", b"//v1/load_lora_adapter", 403, "endpoint_blocked"),
        ("/v1/load_lora_adapter", "GET", None, 403, "endpoint_blocked"),
        ("/no/such/route", "GET", None, 404, "unknown_endpoint"),
        ("/v1/chat/completions", "POST", b"/v1/chat/../chat/completions", 404, "unknown_endpoint"),
        ("/", "GET", None, 404, "unknown_endpoint"),
        ("/healthz", "GET", None, 200, None),
        ("/healthz", "POST", None, 405, "method_not_allowed"),
    ],
)
async def test_endpoint_guard(
    path: str, method: str, raw_path: bytes | None, status: int, code: str | None
) -> None:
    s = stack()
    answer = await call(s.app, scope(path, method, FULL, raw_path=raw_path))
    assert (answer.status, answer.code) == (status, code), answer.body
    assert len(s.inner.scopes) == (1 if status == 200 else 0)


async def test_endpoint_guard_names_the_key_that_probed_a_blocked_route() -> None:
    s = stack()
    await call(s.app, scope("/v1/load_lora_adapter", key=POOLING))
    await call(s.app, scope("/v1/load_lora_adapter", key="sk-not-a-configured-key-000000"))
    assert [line["key_name"] for line in s.logger.lines] == ["pooling", None]
    assert [line["code"] for line in s.logger.lines] == ["endpoint_blocked"] * 2


async def test_endpoint_guard_hands_the_matched_path_on() -> None:
    s = stack()
    await call(s.app, scope("/v1/chat/completions", key=FULL))
    (inner,) = s.inner.scopes
    assert inner["gateway.path"] == "/v1/chat/completions"
    assert exchange_of(inner).route.path == "/v1/chat/completions"


# --- Keys and scopes ---------------------------------------------------


@pytest.mark.parametrize(
    ("path", "method", "authorization", "status", "code"),
    [
        ("/v1/chat/completions", "POST", None, 401, "invalid_api_key"),
        ("/v1/chat/completions", "POST", b"Bearer " + FULL.encode(), 200, None),
        ("/v1/chat/completions", "POST", b"bearer " + FULL.encode(), 200, None),
        ("/v1/chat/completions", "POST", b"Bearer  " + FULL.encode() + b" ", 200, None),
        ("/v1/chat/completions", "POST", b"Basic " + FULL.encode(), 401, "invalid_api_key"),
        ("/v1/chat/completions", "POST", FULL.encode(), 401, "invalid_api_key"),
        (
            "/v1/chat/completions",
            "POST",
            b"Bearer " + WRONG.encode(),
            401,
            "invalid_api_key",
        ),
        ("/v1/chat/completions", "POST", b"Bearer ", 401, "invalid_api_key"),
        ("/v1/chat/completions", "POST", b"Bearer " + POOLING.encode(), 403, "scope_not_allowed"),
        ("/pooling", "POST", b"Bearer " + POOLING.encode(), 200, None),
        ("/pooling", "POST", b"Bearer " + INFERENCE.encode(), 403, "scope_not_allowed"),
        # /invocations runs vLLM's chat and pooling handlers: it needs both scopes.
        ("/invocations", "POST", b"Bearer " + INFERENCE.encode(), 403, "scope_not_allowed"),
        ("/invocations", "POST", b"Bearer " + POOLING.encode(), 403, "scope_not_allowed"),
        ("/invocations", "POST", b"Bearer " + BOTH.encode(), 200, None),
        # The gateway's metrics: only a key granted `metrics`, never implicitly.
        ("/metrics", "GET", None, 401, "invalid_api_key"),
        ("/metrics", "GET", b"Bearer " + FULL.encode(), 403, "scope_not_allowed"),
        ("/metrics", "GET", b"Bearer " + METRICS.encode(), 200, None),
        ("/v1/models", "GET", b"Bearer " + METRICS.encode(), 403, "scope_not_allowed"),
        # Probes need no key.
        ("/healthz", "GET", None, 200, None),
        ("/readyz", "GET", None, 200, None),
    ],
)
async def test_authentication(
    path: str, method: str, authorization: bytes | None, status: int, code: str | None
) -> None:
    s = stack()
    headers = [] if authorization is None else [(b"authorization", authorization)]
    answer = await call(s.app, scope(path, method, headers=headers))
    assert (answer.status, answer.code) == (status, code), answer.body
    assert len(s.inner.scopes) == (1 if status == 200 else 0)


@pytest.mark.parametrize(
    ("public_metrics", "allow_unauthenticated", "authorization", "status", "code"),
    [
        (True, False, None, 200, None),
        (True, False, b"Bearer " + WRONG.encode(), 200, None),
        (False, True, None, 403, "scope_not_allowed"),  # anonymous has no metrics scope
        (False, True, b"Bearer " + METRICS.encode(), 200, None),
    ],
)
async def test_authentication_of_metrics_by_setting(
    public_metrics: bool,
    allow_unauthenticated: bool,
    authorization: bytes | None,
    status: int,
    code: str | None,
) -> None:
    s = stack(public_metrics=public_metrics, allow_unauthenticated=allow_unauthenticated)
    headers = [] if authorization is None else [(b"authorization", authorization)]
    answer = await call(s.app, scope("/metrics", "GET", headers=headers))
    assert (answer.status, answer.code) == (status, code), answer.body


@pytest.mark.parametrize(
    ("authorization", "status", "code", "key_name"),
    [
        (None, 200, None, "anonymous"),
        (b"Bearer " + POOLING.encode(), 403, "scope_not_allowed", "pooling"),
        # A wrong key is refused even when no key is needed: it is a client's mistake.
        (b"Bearer " + WRONG.encode(), 401, "invalid_api_key", None),
    ],
)
async def test_authentication_without_keys_required(
    authorization: bytes | None, status: int, code: str | None, key_name: str | None
) -> None:
    s = stack(allow_unauthenticated=True)
    headers = [] if authorization is None else [(b"authorization", authorization)]
    answer = await call(s.app, scope("/v1/chat/completions", headers=headers))
    assert (answer.status, answer.code) == (status, code), answer.body
    assert s.logger.lines[-1]["key_name"] == key_name


# --- The per-key cap and rate limit ------------------------------------------


class Held:
    """An inner app that holds each request until `release` is set; `arrived` is set
    once `expected` requests are in."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.count += 1
        if self.count >= self.expected:
            self.arrived.set()
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def test_key_cap_refuses_that_key_only_and_frees_its_slots() -> None:
    s = stack(per_key=2)
    held = s.inner.behaviour = Held(2)
    first = asyncio.create_task(call(s.app, scope(key=FULL)))
    second = asyncio.create_task(call(s.app, scope(key=FULL)))
    await held.arrived.wait()
    over = await call(s.app, scope(key=FULL))
    assert (over.status, over.code) == (429, "rate_limited")
    assert over.headers[b"retry-after"] == b"1"
    assert held.count == 2
    # Another key, and the gateway's own routes, still go in.
    s.inner.behaviour = None
    assert (await call(s.app, scope(key=INFERENCE))).status == 200
    assert (await call(s.app, scope("/healthz", "GET"))).status == 200
    s.inner.behaviour = held
    held.release.set()
    assert [(await first).status, (await second).status] == [200, 200]
    assert s.admission.keys == {}
    s.inner.behaviour = None
    assert (await call(s.app, scope(key=FULL))).status == 200
    assert samples(s.metrics, "gateway_rejections_total") == {(("code", "rate_limited"),): 1.0}
    assert samples(s.metrics, "gateway_rate_limited_total") == {(("reason", "in_flight"),): 1.0}


async def test_a_key_of_its_own_cap_is_held_to_it() -> None:
    s = stack(per_key=8)
    held = s.inner.behaviour = Held(1)
    first = asyncio.create_task(call(s.app, scope(key=OWN_CAP)))
    await held.arrived.wait()
    over = await call(s.app, scope(key=OWN_CAP))
    assert (over.status, over.code) == (429, "rate_limited")
    held.release.set()
    assert (await first).status == 200


@pytest.mark.parametrize(
    "failure", [InvalidJson("bad"), RuntimeError("boom"), ClientDisconnected()]
)
async def test_key_slot_is_freed_when_the_request_fails(failure: BaseException) -> None:
    s = stack(per_key=1)

    async def fails(scope: Scope, receive: Receive, send: Send) -> None:
        raise failure

    s.inner.behaviour = fails
    await call(s.app, scope(key=FULL))
    assert s.admission.keys == {}
    s.inner.behaviour = None
    assert (await call(s.app, scope(key=FULL))).status == 200


async def test_rate_limit_per_key_with_burst_and_retry_after() -> None:
    s = stack(rate=RateLimit(requests_per_second=0.5, burst=2))
    statuses = [(await call(s.app, scope(key=FULL))).status for _ in range(2)]
    over = await call(s.app, scope(key=FULL))
    assert statuses == [200, 200]
    assert (over.status, over.code) == (429, "rate_limited")
    # One token every 2 s: the next one is 2 s away.
    assert over.headers[b"retry-after"] == b"2"
    assert len(s.inner.scopes) == 2
    # Another key has its own bucket.
    assert (await call(s.app, scope(key=INFERENCE))).status == 200
    s.clock[0] += 1.5
    early = await call(s.app, scope(key=FULL))
    assert (early.status, early.headers[b"retry-after"]) == (429, b"1")
    s.clock[0] += 0.5
    assert (await call(s.app, scope(key=FULL))).status == 200
    assert samples(s.metrics, "gateway_rate_limited_total") == {(("reason", "rate"),): 2.0}


async def test_a_key_of_its_own_rate_replaces_the_default() -> None:
    s = stack(rate=RateLimit(requests_per_second=100, burst=100))
    assert (await call(s.app, scope(key=OWN_RATE))).status == 200
    assert (await call(s.app, scope(key=OWN_RATE))).status == 429
    assert (await call(s.app, scope(key=FULL))).status == 200


async def test_unauthenticated_requests_share_one_bucket() -> None:
    s = stack(allow_unauthenticated=True, rate=RateLimit(requests_per_second=1, burst=2))
    statuses = [(await call(s.app, scope())).status for _ in range(3)]
    assert statuses == [200, 200, 429]


# --- Context: ids, the error renderer, the log line -----------------------------


def _raises(exc: BaseException, after_start: bool = False) -> Any:
    async def behaviour(scope: Scope, receive: Receive, send: Send) -> None:
        if after_start:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise exc

    return behaviour


@pytest.mark.parametrize(
    ("behaviour", "status", "code", "logged_status", "logged_code"),
    [
        (None, 200, None, 200, None),
        (_raises(InvalidJson("Not JSON.")), 400, "invalid_json", 400, "invalid_json"),
        # An error after the answer started cannot be rendered: the log still says so.
        (_raises(InvalidJson("late"), after_start=True), 200, None, 200, "invalid_json"),
        (_raises(RuntimeError("secret detail")), 500, "internal_error", 500, "internal_error"),
        (_raises(ClientDisconnected()), None, None, 499, "client_disconnected"),
    ],
)
async def test_request_context_renders_errors_once_and_logs_every_request(
    behaviour: Any, status: int | None, code: str | None, logged_status: int, logged_code: str
) -> None:
    s = stack()
    s.inner.behaviour = behaviour
    answer = await call(s.app, scope(key=FULL))
    assert (answer.status, answer.code) == (status, code), answer.body
    assert b"secret detail" not in answer.body  # library text never reaches a client
    (line,) = s.logger.lines
    assert (line["status"], line["code"]) == (logged_status, logged_code)
    assert line["key_name"] == "full" and line["group"] == "inference"
    assert s.logger.exceptions == (["unhandled_error"] if status == 500 else [])
    if answer.status is not None:
        assert answer.headers[b"x-request-id"].decode() == line["request_id"]


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (b"client-id.1:2_3", True),
        (b"a" * 128, True),
        (b"a" * 129, False),
        (b"has space", False),
        (b"semi;colon", False),
        (b"", False),
        (None, False),
    ],
)
async def test_request_context_takes_only_a_plain_client_request_id(
    given: bytes | None, kept: bool
) -> None:
    s = stack()
    headers = [] if given is None else [(b"x-request-id", given)]
    answer = await call(s.app, scope(key=FULL, headers=headers))
    request_id = answer.headers[b"x-request-id"]
    (line,) = s.logger.lines
    if kept:
        assert given is not None and request_id == given
        # The engine gets the client's id made unique, so no tenant can name another's.
        client, _, suffix = line["engine_request_id"].rpartition("-")
        assert client == given.decode() and len(suffix) == 16
    else:
        assert len(request_id) == 32 and int(request_id, 16) >= 0
        assert line["engine_request_id"] == request_id.decode()


@pytest.mark.parametrize(
    ("count", "status", "code"), [(5, 200, None), (6, 431, "too_many_headers")]
)
async def test_request_context_caps_the_header_count_first(
    count: int, status: int, code: str | None
) -> None:
    s = stack(max_headers=5)
    # `count` fields, the key last; more than the cap is refused before anything reads
    # them, the client's own request id included.
    headers = [(b"x-request-id", b"mine")] + [(b"x-filler", b"1")] * (count - 2)
    answer = await call(s.app, scope(key=FULL, headers=headers))
    assert (answer.status, answer.code) == (status, code), answer.body
    assert (answer.headers[b"x-request-id"] == b"mine") == (status == 200)
    assert len(s.inner.scopes) == (1 if status == 200 else 0)


async def test_request_context_counts_requests_and_the_gateways_own_refusals() -> None:
    s = stack()
    await call(s.app, scope(key=FULL))
    await call(s.app, scope(key=None))
    await call(s.app, scope("/v1/load_lora_adapter", key=FULL))
    requests = samples(s.metrics, "gateway_requests_total")
    # By the key's name; the empty name when no valid key was presented.
    assert requests == {
        (("code", ""), ("group", "inference"), ("key", "full"), ("status", "200")): 1.0,
        (("code", "invalid_api_key"), ("group", "inference"), ("key", ""), ("status", "401")): 1.0,
        (
            ("code", "endpoint_blocked"),
            ("group", "blocked"),
            ("key", "full"),
            ("status", "403"),
        ): 1.0,
    }
    assert samples(s.metrics, "gateway_rejections_total") == {
        (("code", "invalid_api_key"),): 1.0,
        (("code", "endpoint_blocked"),): 1.0,
    }
