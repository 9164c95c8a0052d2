"""The whole app in process (gateway/app.py): `create_app(settings, upstream=...)` with a
fake engine behind the `UpstreamClient` seam, driven by hand-written ASGI messages: the
lifespan's startup and shutdown, then requests as uvicorn would send them. Refusals are
checked for their status, their stable `code`, and that the fake engine saw nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from gateway.app import Gateway, create_app
from gateway.config.settings import Settings
from gateway.types import Message
from tests.unit.engines import FakeEngine, FakeResponse, Sent

KEY = "sk-unit-app-0123456789abcdef"
MODEL = "unit-model"
ENGINE = "http://127.0.0.1:9"
# Requests the pool sends by itself (health checks, model lists, load scrapes).
POOL_PATHS = frozenset({"/health", "/v1/models", "/metrics"})
MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
)


@dataclass
class ServingEngine(FakeEngine):
    """A healthy engine serving MODEL; records every request the gateway forwards."""

    forwarded: list[Sent] = field(default_factory=list)
    answers: list[FakeResponse] = field(default_factory=list)

    async def answer(self, sent: Sent) -> FakeResponse:
        path = sent.target.split("?", 1)[0]
        if path in POOL_PATHS:
            return FakeResponse(200, [MODELS if path == "/v1/models" else b""], "application/json")
        self.forwarded.append(sent)
        answer = FakeResponse(200, [ANSWER[:20], ANSWER[20:]], "application/json")
        self.answers.append(answer)
        return answer


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def code(self) -> str:
        return str(orjson.loads(self.body)["error"]["code"])


class Lifespan:
    """The ASGI lifespan run by hand: startup on enter, shutdown on exit."""

    def __init__(self, app: Gateway) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lifespan:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        self._task = asyncio.create_task(self.app(scope, self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        assert (await self._outbox.get())["type"] == "lifespan.startup.complete"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inbox.put({"type": "lifespan.shutdown"})
        assert (await self._outbox.get())["type"] == "lifespan.shutdown.complete"
        assert self._task is not None
        await self._task

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Answer:
        """One request as uvicorn hands it to the app; the answer read from `send`."""
        raw = [(b"host", b"gw"), (b"content-length", str(len(body)).encode()), *headers]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": raw,
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
            "state": dict(self.state),
        }
        done = asyncio.Event()
        requests = [{"type": "http.request", "body": body, "more_body": False}]
        messages: list[Message] = []

        async def receive() -> Message:
            if requests:
                return requests.pop(0)
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            messages.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        await asyncio.wait_for(self.app(scope, receive, send), 10)
        start = messages[0]
        assert start["type"] == "http.response.start"
        assert done.is_set(), "the response never ended"
        return Answer(
            start["status"],
            dict(start.get("headers", [])),
            b"".join(m.get("body", b"") for m in messages[1:]),
        )


def settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "engines": [ENGINE],
        "api_keys": [KEY],
        "routing": {"load_interval": 0},
    }
    return Settings(**{**base, **overrides})


@asynccontextmanager
async def running(engine: ServingEngine, **overrides: Any) -> AsyncIterator[Lifespan]:
    async with Lifespan(create_app(settings(**overrides), upstream=engine)) as app:
        yield app


AUTH = (b"authorization", f"Bearer {KEY}".encode())
JSON = (b"content-type", b"application/json")


def chat(**extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status", "code"),
    [
        ("POST", "/v1/nothing-here", [AUTH, JSON], chat(), 404, "unknown_endpoint"),
        ("GET", "/v2/models", [AUTH], b"", 404, "unknown_endpoint"),
        ("POST", "/v1/load_lora_adapter", [AUTH, JSON], b"{}", 403, "endpoint_blocked"),
        ("POST", "/collective_rpc", [AUTH, JSON], b"{}", 403, "endpoint_blocked"),
        # A blocked route is refused with or without a key.
        ("POST", "/start_profile", [JSON], b"{}", 403, "endpoint_blocked"),
        ("POST", "/v1/chat/completions", [JSON], chat(), 401, "invalid_api_key"),
        ("POST", "/v1/chat/completions", [(b"authorization", b"Bearer sk-wrong"), JSON], chat(),
         401, "invalid_api_key"),
        ("GET", "/v1/models", [], b"", 401, "invalid_api_key"),
        ("POST", "/v1/chat/completions", [AUTH, JSON], chat(priority=5), 400, "field_not_allowed"),
        ("POST", "/v1/chat/completions", [AUTH, JSON], chat(vllm_xargs={"k": 1}), 400,
         "field_not_allowed"),
        ("POST", "/v1/responses", [AUTH, JSON],
         orjson.dumps({"model": MODEL, "input": "hi", "background": True}), 400,
         "field_not_allowed"),
        ("POST", "/v1/chat/completions", [AUTH, JSON], b"{not json", 400, "invalid_json"),
        ("GET", "/v1/chat/completions", [AUTH], b"", 405, "method_not_allowed"),
    ],
)  # fmt: skip
async def test_refusals_never_reach_the_engine(
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    status: int,
    code: str,
) -> None:
    engine = ServingEngine()
    async with running(engine) as app:
        answer = await app.request(method, path, body, headers)
    assert (answer.status, answer.code()) == (status, code)
    assert engine.forwarded == []
    assert KEY.encode() not in answer.body
    assert len(answer.headers[b"x-request-id"]) == 32


async def test_a_forwarded_request_reaches_the_engine_and_its_answer_the_client() -> None:
    engine = ServingEngine()
    async with running(engine) as app:
        answer = await app.request("POST", "/v1/chat/completions", chat(), [AUTH, JSON])
    assert answer.status == 200
    assert answer.body == ANSWER
    [sent] = engine.forwarded
    assert (sent.method, sent.target) == ("POST", "/v1/chat/completions")
    assert sent.body is not None and orjson.loads(sent.body)["messages"][0]["content"] == "hi"
    # The client's key stays at the gateway.
    assert all(KEY.encode() not in value for _, value in sent.headers)
    assert engine.answers[0].closed


async def test_the_engine_key_replaces_the_clients() -> None:
    engine = ServingEngine()
    async with running(engine, upstream_api_key="engine-secret-key") as app:
        answer = await app.request("POST", "/v1/chat/completions", chat(), [AUTH, JSON])
    assert answer.status == 200
    [sent] = engine.forwarded
    assert [v for n, v in sent.headers if n == b"authorization"] == [b"Bearer engine-secret-key"]


async def test_an_allowed_opt_in_field_is_forwarded() -> None:
    """The refusal of `priority` above is the setting's, not the field's."""
    engine = ServingEngine()
    async with running(engine, payload={"allow_priority": True}) as app:
        answer = await app.request("POST", "/v1/chat/completions", chat(priority=5), [AUTH, JSON])
    assert answer.status == 200
    [sent] = engine.forwarded
    assert sent.body is not None and orjson.loads(sent.body)["priority"] == 5


async def test_models_are_listed_from_the_pool_without_an_engine_request() -> None:
    engine = ServingEngine()
    async with running(engine) as app:
        answer = await app.request("GET", "/v1/models", b"", [AUTH])
    assert answer.status == 200
    assert [m["id"] for m in orjson.loads(answer.body)["data"]] == [MODEL]
    assert engine.forwarded == []


async def test_the_lifespan_closes_the_upstream_client() -> None:
    engine = ServingEngine()
    async with running(engine) as app:
        ready = await app.request("GET", "/readyz")
        assert ready.status == 200 and not engine.closed
    assert engine.closed


async def test_a_websocket_is_refused() -> None:
    engine = ServingEngine()
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async with running(engine) as app:
        await app.app({"type": "websocket", "path": "/v1/realtime"}, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]
    assert engine.forwarded == []
