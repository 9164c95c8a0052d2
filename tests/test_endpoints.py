"""The endpoint table as a table of raw paths and verdicts (in-process, no servers)."""

from __future__ import annotations

import pytest

from gateway.endpoints import TABLE, Action, BodyKind, Group, canonical_form, match

FORWARDED = [
    ("/v1/chat/completions", Group.inference),
    ("/v1/completions", Group.inference),
    ("/v1/responses", Group.inference),
    ("/v1/responses/resp_abc-123", Group.inference),
    ("/v1/responses/resp_ABC/cancel", Group.inference),
    ("/v1/messages", Group.inference),
    ("/v1/messages/count_tokens", Group.inference),
    ("/invocations", Group.inference),
    ("/generative_scoring", Group.inference),
    ("/cohere/v2/chat", Group.inference),
    ("/v1/embeddings", Group.pooling),
    ("/v2/embed", Group.pooling),
    ("/pooling", Group.pooling),
    ("/classify", Group.pooling),
    ("/score", Group.pooling),
    ("/v1/score", Group.pooling),
    ("/rerank", Group.pooling),
    ("/v1/rerank", Group.pooling),
    ("/v2/rerank", Group.pooling),
    ("/tokenize", Group.tokenize),
    ("/detokenize", Group.tokenize),
    ("/v1/audio/transcriptions", Group.audio),
    ("/v1/audio/translations", Group.audio),
    ("/v1/models", Group.models),
    ("/health", Group.info),
    ("/ping", Group.info),
    ("/version", Group.info),
    ("/load", Group.info),
]

BLOCKED = [
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/adapters",
    "/adapters/my-lora",
    "/collective_rpc",
    "/server_info",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/update_weights_from_disk",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/abort_requests",
    "/start_profile",
    "/stop_profile",
    "/fault_tolerance/status",
    "/inference/v1/generate",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/kv_event_sources",
    "/docs",
    "/redoc",
    "/openapi.json",
    "/v1/realtime",
]

UNKNOWN = [
    "/",
    "/v1",
    "/v1/chat",
    "/metrics/extra",
    "/v1/responses/a/b",
    "/v1/responses/" + "x" * 200,
    "/v1/files",
    "/v3/rerank",
]


@pytest.mark.parametrize(("path", "group"), FORWARDED)
def test_forwarded_routes(path: str, group: Group) -> None:
    m = match(path.encode())
    assert m.route.action is Action.forward
    assert m.route.group is group
    assert m.path == path


@pytest.mark.parametrize("path", BLOCKED)
def test_blocked_routes(path: str) -> None:
    m = match(path.encode())
    assert m.route.action is Action.blocked
    assert m.route.reason


@pytest.mark.parametrize("path", UNKNOWN)
def test_unknown_routes(path: str) -> None:
    assert match(path.encode()).route.action is Action.unknown


def test_gateway_routes_are_local_and_engine_metrics_is_not_forwarded() -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert match(path.encode()).route.action is Action.local
    assert match(b"/metrics").route.group is Group.metrics


def test_every_vllm_open_route_is_classified() -> None:
    # The routes vLLM's --api-key leaves open (VLLM-FACTS.md) are all in the table.
    for path in ("/score", "/rerank", "/pooling", "/classify", "/tokenize", "/detokenize",
                 "/invocations", "/generative_scoring", "/health", "/ping", "/version",
                 "/load", "/adapters", "/scale_elastic_ep"):  # fmt: skip
        assert path in TABLE


def test_json_routes_check_the_model_and_audio_streams() -> None:
    assert TABLE["/v1/chat/completions"].body is BodyKind.json
    assert TABLE["/v1/chat/completions"].check_model
    assert TABLE["/v1/audio/transcriptions"].body is BodyKind.multipart
    assert TABLE["/v1/models"].body is BodyKind.none


# Spelling tricks: none may be forwarded; a blocked route stays blocked.
TRICKS = [
    ("//v1/chat/completions", Action.unknown),
    ("/v1//chat/completions", Action.unknown),
    ("/v1/chat/completions/", Action.unknown),
    ("/v1/./chat/completions", Action.unknown),
    ("/v1/x/../chat/completions", Action.unknown),
    ("/V1/chat/completions", Action.unknown),
    ("/v1/chat/Completions", Action.unknown),
    ("/v1/chat%2fcompletions", Action.unknown),
    ("/v1/chat/completions%00", Action.unknown),
    ("/v1/chat/completions;x=1", Action.unknown),
    ("/%761/chat/completions", Action.unknown),
    ("/health/", Action.unknown),
    ("/v1/models%2e", Action.unknown),
    # Blocked routes keep their verdict under any spelling.
    ("/v1/load_lora_adapter/", Action.blocked),
    ("//v1/load_lora_adapter", Action.blocked),
    ("/V1/LOAD_LORA_ADAPTER", Action.blocked),
    ("/v1/%6coad_lora_adapter", Action.blocked),
    ("/v1/%256coad_lora_adapter", Action.blocked),
    ("/v1/chat/../load_lora_adapter", Action.blocked),
    ("/v1/models/..%2fload_lora_adapter", Action.blocked),
    ("/adapters;x", Action.blocked),
    ("/adapters%00", Action.blocked),
    ("/x/../collective_rpc", Action.blocked),
    ("/inference/v1/../v1/generate", Action.blocked),
    ("/Inference/v1/generate", Action.blocked),
    ("/v1\\load_lora_adapter", Action.blocked),
]


@pytest.mark.parametrize(("path", "action"), TRICKS)
def test_path_tricks(path: str, action: Action) -> None:
    assert match(path.encode("latin-1")).route.action is action


def test_canonical_form() -> None:
    assert canonical_form(b"//V1/./x/../Chat/completions/;a=b") == "/v1/chat/completions"
    assert canonical_form(b"/a%252fb") == "/a/b"
