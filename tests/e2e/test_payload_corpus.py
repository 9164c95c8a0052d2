"""The generated corpus (tests/e2e/corpus.py) through the running gateway.

A black-box check of the body walk: whatever the walker looks like, every generated body
is refused with a documented 4xx code, or forwarded with every media reference it carried
rewritten to a validated `data:` URL; a canary URL in any media position is refused
before any connection; legitimate bodies are served.

Processes, started once for the module: the gateway under uvicorn (inline mode, the
default) in front of a recording engine (a threaded HTTP server on loopback that answers
every POST with 200 and keeps every body it received, and lists one model on
/v1/models); in-process, the allowed media `origin` and a `canary` that is never allowed
and must never be contacted.

Two tests: a deterministic slice of the grammar (`corpus.fast_slice`, several hundred
cases) and a Hypothesis test that mutates valid bodies (extra keys, odd `type` values,
parts wrapped in lists and objects, duplicated parts, media moved to unusual places).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.harness.metrics import HTTP
from bench.harness.origin import QuietHandler, ThreadedServer
from tests.e2e import corpus
from tests.e2e.corpus import Case, Fill, Outcome
from tests.procs import (
    Proc,
    RecordingServer,
    Route,
    gateway_proc,
    media_gateway_env,
    wait_for,
)

MODEL = "corpus/tiny-vl"
KEY = "sk-corpus-0123456789abcdef"
ENGINE_REPLY = json.dumps(
    {
        "id": "cmpl-corpus",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


class RecordingEngine(ThreadedServer):
    """An engine stand-in on loopback: GET /health and /v1/models answer as vLLM does,
    every POST gets 200 with a minimal chat completion, and its body is recorded."""

    def __init__(self, model: str) -> None:
        self.received: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        outer = self
        models = json.dumps(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm"}]}
        ).encode()

        class Handler(QuietHandler):
            def _reply(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._reply(models if self.path.startswith("/v1/models") else b"{}")

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                with outer._lock:
                    outer.received.append((self.path, body))
                self._reply(ENGINE_REPLY)

        super().__init__(Handler)


@dataclass
class Stack:
    gateway: Proc
    engine: RecordingEngine
    origin: RecordingServer
    canary: RecordingServer
    http: httpx.Client
    fill: Fill

    def send(self, route: str, body: Any) -> Outcome:
        before = len(self.engine.received)
        r = self.http.post(
            self.gateway.url + route,
            content=self.fill.body(body),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        code = None
        if r.status_code >= 400:
            try:
                code = r.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
        return Outcome(r.status_code, code, list(self.engine.received[before:]))

    def check(self, case_id: str, route: str, body: Any, *, evil: bool, legit: bool) -> None:
        outcome = self.send(route, body)
        corpus.check(
            case_id, route, body, evil, legit, outcome,
            urls=self.fill.urls(), fill=self.fill,
            canary_contacts=self.canary.connections + len(self.canary.hits),
            engine_path=route,
        )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("payload-corpus")
    routes = {
        path: Route(body=data, headers={"Content-Type": mime})
        for path, (data, mime) in corpus.ORIGIN_FILES.items()
    }
    with (
        RecordingEngine(MODEL) as engine,
        RecordingServer() as canary,
        RecordingServer(routes) as origin,
    ):
        env = media_gateway_env(
            engine.url, KEY, f"127.0.0.1:{origin.port}", "http",
            GATEWAY_ROUTING__HEALTH_INTERVAL="30",
        )  # fmt: skip
        gateway = gateway_proc(tmp, env)
        try:
            gateway.start("/healthz")
            assert wait_for(lambda: HTTP.get(gateway.url + "/readyz").status_code == 200)
            with httpx.Client(timeout=15) as http:
                yield Stack(gateway, engine, origin, canary, http,
                            Fill(origin.url, canary.url, MODEL))  # fmt: skip
        finally:
            gateway.stop()
        # Invariant 1 over the whole module, whatever failed in between.
        assert canary.connections == 0 and not canary.hits, canary.hits[:5]


FAST = corpus.fast_slice()


def test_the_slice_covers_the_grammar() -> None:
    """The slice is what the docstring says: each container, shape, decoration and
    nesting meets the canary, legitimate bodies are a good share, data and mentions are
    in."""
    ids = [c.id.split("/") for c in FAST if c.id.count("/") == 4]
    assert {i[0] for i in ids} == set(corpus.CONTAINER)
    assert {i[1] for i in ids if i[2] == "canary"} == {
        s.name for s in corpus.SHAPES if "canary" in s.sources
    }
    assert {i[3] for i in ids if i[2] == "canary"} == set(corpus.DECORATIONS)
    assert {i[4] for i in ids if i[2] == "canary"} >= set(corpus.NESTINGS) | set(corpus.VALUE_WRAPS)
    assert {i[0] for i in ids if i[2] == "origin"} == set(corpus.CONTAINER)
    legit = [c for c in FAST if c.legit]
    assert len(legit) > 100 and sum(c.evil for c in FAST) > 300
    assert any(c.id.startswith("mention/") for c in legit)
    assert any("/data/" in c.id for c in legit) and any("/origin/" in c.id for c in legit)
    assert all(c.media for c in FAST if not c.id.startswith("mention/") and "/embeds/" not in c.id)
    assert 400 < len(FAST) < 1200


@pytest.mark.slow
@pytest.mark.parametrize("case", FAST, ids=corpus.ids(FAST))
def test_generated_body(stack: Stack, case: Case) -> None:
    stack.check(case.id, case.route, case.body, evil=case.evil, legit=case.legit)


# --- Hypothesis: mutations of valid bodies ------------------------------------------

# Bases: legitimate bodies with the origin or data, and the same bodies with the canary.
_BASES = [
    corpus.make(c, s, source)
    for c, s in [
        ("chat_user", "image_url"), ("chat_tool", "input_image"),
        ("chat_assistant", "image_url_bare"), ("tokenize", "image_url_untyped"),
        ("invocations_chat", "image_url"), ("batch_chat", "video_url"),
        ("embeddings", "image_url"), ("cohere_chat", "image_url_detail"),
        ("responses_message", "input_image"), ("responses_typed_message", "image_url"),
        ("responses_function_output", "input_image"),
        ("responses_custom_tool_output", "input_image"),
        ("messages_user", "anthropic_url"), ("messages_tool_result", "anthropic_url"),
        ("count_tokens", "anthropic_url"), ("score_queries", "image_url"),
        ("rerank_v2", "video_url"), ("embed_v2_inputs", "image_url"),
        ("pooling", "audio_url"), ("classify", "audio_url_bare"),
    ]
    for source in ("origin", "canary")
] + [corpus.make("chat_user", "input_audio", "data"),
     corpus.make("messages_user", "anthropic_base64", "data")]  # fmt: skip

_ODD_TYPES = [None, 7, 1.5, True, "", "text", "image", "IMAGE_URL", "input_image", "message",
              "function_call_output", "custom_tool_call_output", "tool_result", "image_url ",
              ["image_url"], {"type": "image_url"}, []]  # fmt: skip
_EXTRA_KEYS = ["role", "name", "uuid", "id", "content", "x-extra", "metadata", "status",
               "detail", "call_id", "output", "input"]  # fmt: skip
_EXTRA_VALUES = [None, "user", "assistant", 1, [], {}, "text", {"role": "user"}, [None],
                 [{"type": "text", "text": "hi"}]]  # fmt: skip
_WRAP_KEYS = ["x", "content", "output", "input", "data", "item", "messages", "parts"]
_MOVE_TO = ["metadata", "extra_body", "tools", "documents", "query", "prompt", "inputs", "x"]


_MEDIA_VALUE_KEYS = ("image_url", "video_url", "audio_url", "input_audio", "source")


def _parts(body: Any) -> list[corpus.Path]:
    """Paths of the media parts: the objects that hold a media key."""
    out = set()
    for p in corpus.media_paths(body):
        value_at = next(
            (i for i in range(len(p) - 1, -1, -1) if p[i] in _MEDIA_VALUE_KEYS), len(p) - 1
        )
        out.add(p[:value_at])
    return sorted(out, key=str)


def _media_values(body: Any) -> list[corpus.Path]:
    """Paths of the values under media keys (`image_url: {...}`, `source: {...}`, ...)."""
    return sorted(
        {(*part, k) for part in _parts(body) for k in corpus.get(body, part)
         if k in _MEDIA_VALUE_KEYS},
        key=str,
    )  # fmt: skip


def _above(body: Any, paths: list[corpus.Path]) -> list[corpus.Path]:
    """The given paths and every container above them, but the root."""
    return sorted({p[:i] for p in paths for i in range(1, len(p) + 1)}, key=str)


def _replace(body: Any, path: corpus.Path, value: Any) -> None:
    corpus.get(body, path[:-1])[path[-1]] = value


Example = tuple[Case, dict[str, Any], list[str]]


def _mutate_shared(
    draw: st.DrawFn, op: str, body: dict[str, Any], path: corpus.Path, node: Any, log: list[str]
) -> bool:
    """The mutations both strategies make: an extra key (never overwriting what is there,
    the media or the content), an odd `type`, the node wrapped in a list or an object.
    False when `op` is none of these."""
    if op == "key":
        key, value = draw(st.sampled_from(_EXTRA_KEYS)), draw(st.sampled_from(_EXTRA_VALUES))
        if key not in node:
            node[key] = copy.deepcopy(value)
            log.append(f"{path}.{key}={value!r}")
    elif op == "type":
        node["type"] = copy.deepcopy(draw(st.sampled_from(_ODD_TYPES)))
        log.append(f"{path}.type={node['type']!r}")
    elif op == "wrap_list":
        _replace(body, path, [node])
        log.append(f"{path} -> [..]")
    elif op == "wrap_dict":
        key = draw(st.sampled_from(_WRAP_KEYS))
        _replace(body, path, {key: node})
        log.append(f"{path} -> {{{key}: ..}}")
    else:
        return False
    return True


# Picks the path an operation applies to (and may change the operation).
Pick = Callable[[st.DrawFn, str, dict[str, Any]], tuple[str, corpus.Path]]
# Applies an operation `_mutate_shared` does not know.
Own = Callable[[st.DrawFn, str, dict[str, Any], corpus.Path, Any, list[str]], None]


def _mutated(draw: st.DrawFn, rounds: int, ops: list[str], pick: Pick, own: Own) -> Example:
    """A base case's body after 1 to `rounds` operations drawn from `ops`, with the log
    of what was done."""
    base = draw(st.sampled_from(_BASES))
    body = copy.deepcopy(base.body)
    log: list[str] = []
    for _ in range(draw(st.integers(1, rounds))):
        op, path = pick(draw, draw(st.sampled_from(ops)), body)
        node = corpus.get(body, path)
        if not _mutate_shared(draw, op, body, path, node, log):
            own(draw, op, body, path, node, log)
    return base, body, log


def _pick_part(draw: st.DrawFn, op: str, body: dict[str, Any]) -> tuple[str, corpus.Path]:
    parts = _parts(body)
    if op in ("wrap_list", "wrap_dict"):
        return op, draw(st.sampled_from(_above(body, parts)))
    return op, draw(st.sampled_from(parts))


def _mutate_part(
    draw: st.DrawFn, op: str, body: dict[str, Any], path: corpus.Path, node: Any, log: list[str]
) -> None:
    if op == "untype":
        node.pop("type", None)
        log.append(f"{path} -type")
    else:
        parent = corpus.get(body, path[:-1])
        if isinstance(parent, list):
            parent.append(copy.deepcopy(node))
            log.append(f"dup {path}")


@st.composite
def mutated_parts(draw: st.DrawFn) -> Example:
    """Mutations of the media parts and of everything above them: extra keys (`role`,
    `name`, `uuid`, unknown...), `type` changed to odd values or removed, parts and their
    containers wrapped in lists and objects, parts duplicated next to themselves. Every
    media value stays where vLLM reads it, under its media key."""
    ops = ["key", "key", "type", "untype", "wrap_list", "wrap_dict", "dup"]
    return _mutated(draw, 4, ops, _pick_part, _mutate_part)


def _pick_value(draw: st.DrawFn, op: str, body: dict[str, Any]) -> tuple[str, corpus.Path]:
    values = [v for v in _media_values(body) if isinstance(corpus.get(body, v), dict)]
    if op == "move_part" or not values:
        op, values = "move_part", _parts(body)
    return op, draw(st.sampled_from(values))


def _mutate_value(
    draw: st.DrawFn, op: str, body: dict[str, Any], path: corpus.Path, node: Any, log: list[str]
) -> None:
    if op == "copy":
        node[draw(st.sampled_from(_WRAP_KEYS))] = copy.deepcopy(node)
        log.append(f"copy {path}")
    else:  # move the part or the value to an unusual top-level place
        key = draw(st.sampled_from(_MOVE_TO))
        holder = body.setdefault(key, [])
        if not isinstance(holder, list):
            body[key] = holder = [holder]
        holder.append(node)
        _replace(body, path, {"type": "text", "text": "moved"})
        log.append(f"move {path} -> {key}")


@st.composite
def mutated_media(draw: st.DrawFn) -> Example:
    """Mutations of the media values themselves and of where they sit: the value under a
    media key wrapped in a list or an object, extra keys or a `type` on it, a copy of it
    under another key inside it, the part or the value moved to an unusual top-level
    field. The URL is still in the body; wherever it went, it must not reach the engine
    as a URL (brief, invariant 4), and a canary must not be forwarded."""
    ops = ["wrap_list", "wrap_dict", "key", "type", "copy", "move", "move_part"]
    return _mutated(draw, 3, ops, _pick_value, _mutate_value)


_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    # Each example is a request through the gateway: no shrinking (a failure prints the
    # example and its mutation log as generated).
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _check_mutated(stack: Stack, example: Example) -> None:
    base, body, log = example
    # Mutations keep every media value in the body. A canary body stays evil while its
    # canary sits in a media position; moved to a field no vLLM code reads as media (a
    # `{"url": ...}` under `query` of /tokenize, say), it is text, and may be forwarded.
    evil = any(
        isinstance(v, str) and v.startswith(corpus.CANARY) and corpus.in_media_position(body, p)
        for p, v in corpus.walk(body)
    )
    assert evil == base.evil or any(step.startswith("move ") for step in log), log
    stack.check(f"{base.id} {log}", base.route, body, evil=evil, legit=False)


@pytest.mark.slow
@_SETTINGS
@given(example=mutated_parts())
def test_mutated_parts(stack: Stack, example: Example) -> None:
    _check_mutated(stack, example)


@pytest.mark.slow
@_SETTINGS
@given(example=mutated_media())
def test_mutated_media_values(stack: Stack, example: Example) -> None:
    _check_mutated(stack, example)
