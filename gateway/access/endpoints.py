"""The endpoint table: every route vLLM serves, and what the gateway does with it.

Default deny: a path is forwarded only because this table lists it. Blocked routes are
refused with 403 (they exist on vLLM and are dangerous: runtime LoRA loading, dev mode,
scaling, profiling), everything else is 404. Neither is ever forwarded.

Matching is exact on the raw request path (the bytes on the wire, not a decoded form).
A path that is not in canonical form (percent escapes, `//`, dot segments, a trailing
slash, upper case, `;` parameters, NUL or other bytes outside the route alphabet) is
never forwarded: it gets the verdict of its canonical form if that is blocked, else 404.
So a spelling trick can only turn a route into a refusal, never into a different route:
an auth check that reads a path other than the one routed is a bypass (CVE-2026-48746).

The query string is held to the same rule: a route forwards only the query parameters
its entry declares (none, for every route but `GET /v1/responses/{id}`), each checked
and written again by `forwarded_query`; anything else is refused, never passed on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final
from urllib.parse import unquote_to_bytes

from gateway.errors import FieldNotAllowed, InvalidRequest


class Group(StrEnum):
    """Route groups: the unit an API key's scopes grant."""

    inference = "inference"
    pooling = "pooling"
    tokenize = "tokenize"
    audio = "audio"
    models = "models"
    info = "info"
    # The gateway's own /metrics; never granted implicitly (a key without `scopes` gets
    # FORWARDED_GROUPS: config/key_file.py).
    metrics = "metrics"
    # The gateway's control routes (/gateway/status, its OpenAPI schema); never
    # granted implicitly either.
    admin = "admin"


FORWARDED_GROUPS: Final = frozenset(
    {Group.inference, Group.pooling, Group.tokenize, Group.audio, Group.models, Group.info}
)
ALL_SCOPES: Final = frozenset(Group)


class Action(StrEnum):
    forward = "forward"
    blocked = "blocked"
    # Answered by the gateway itself: /v1/models from the pool's lists (app.ModelList),
    # the rest by its control plane (gateway/control.py).
    local = "local"
    unknown = "unknown"


class BodyKind(StrEnum):
    none = "none"
    # Read whole (with the body cap), parsed once, `model` checked.
    json = "json"
    # Streamed to the engine under the upload cap.
    multipart = "multipart"


class QueryValue(StrEnum):
    """What a declared query parameter holds, as the engine's FastAPI handler reads it."""

    # A `bool` parameter: pydantic's spellings, any case; forwarded as `true` or `false`.
    boolean = "boolean"
    # An `int` parameter (an index, a count): 0 to 999,999,999 in decimal digits.
    number = "number"


# The strings pydantic 2 reads as a bool (case aside), and the form forwarded for each.
_BOOLEANS: Final = {
    **dict.fromkeys(("true", "1", "yes", "on", "t", "y"), "true"),
    **dict.fromkeys(("false", "0", "no", "off", "f", "n"), "false"),
}
_COUNT = re.compile(rb"[0-9]{1,9}")


@dataclass(frozen=True, slots=True)
class Route:
    """One entry of the table. `path` is the canonical path that is forwarded."""

    path: str
    action: Action
    group: Group | None = None
    methods: frozenset[str] = frozenset()
    body: BodyKind = BodyKind.none
    # Why a route is blocked; the reason goes into the error message.
    reason: str = ""
    # The query parameters the route forwards, by name; any other is refused.
    query: tuple[tuple[str, QueryValue], ...] = ()
    # Low-cardinality name for logs and metrics: the group's, else the action's. Set
    # once: an enum's `.value` is two Python calls, read twice per request.
    label: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        label = self.group.value if self.group is not None else self.action.value
        object.__setattr__(self, "label", label)


_POST = frozenset({"POST"})
_GET = frozenset({"GET"})


def _json(path: str, group: Group) -> Route:
    return Route(path, Action.forward, group, _POST, BodyKind.json)


def _get(path: str, group: Group) -> Route:
    return Route(path, Action.forward, group, _GET)


def _blocked(path: str, reason: str) -> Route:
    return Route(path, Action.blocked, reason=reason)


_LORA = "runtime LoRA loading lets a caller choose files the engine reads"
_DEV = "vLLM dev-mode routes run engine methods and change server state"
_CONTROL = "scaling, abort and profiling routes control the engine"
_RENDER = "render routes are not served through this gateway"
_INTERNAL = "internal vLLM routes are not served through this gateway"
_DOCS = "the engine's API docs are not exposed"
_REALTIME = "WebSocket routes are not proxied by this gateway"
_WEIGHTS = "weight-transfer routes replace the model's weights"

# Creates a stored response (with vLLM's response store on), which the routes
# /v1/responses/{id} and /v1/responses/{id}/cancel name (see `stored_response_id`).
# Answered by the gateway itself, from the pool's copy of the engines' lists (app.py).
MODELS_PATH: Final = "/v1/models"
RESPONSES_PATH: Final = "/v1/responses"

_ROUTES: Final[tuple[Route, ...]] = (
    # --- inference: generation, guarded or not by vLLM's own --api-key ---------------
    _json("/v1/chat/completions", Group.inference),
    _json("/v1/chat/completions/batch", Group.inference),
    _json("/v1/completions", Group.inference),
    _json(RESPONSES_PATH, Group.inference),
    _json("/v1/messages", Group.inference),
    _json("/v1/messages/count_tokens", Group.inference),
    _json("/cohere/v2/chat", Group.inference),
    # SageMaker entry point: full chat/completion/pooling, open in vLLM (vllm#58144).
    _json("/invocations", Group.inference),
    _json("/generative_scoring", Group.inference),
    # Structured decisions: media come as top-level URL lists (`images`, `audio`,
    # `videos`), which the body walk checks and inlines like content parts
    # (docs/vllm.md, "Where vLLM reads media").
    _json("/v1/systemone", Group.inference),
    # --- pooling and scoring ----------------------------------------------------------
    _json("/v1/embeddings", Group.pooling),
    _json("/v2/embed", Group.pooling),
    _json("/pooling", Group.pooling),
    _json("/classify", Group.pooling),
    _json("/score", Group.pooling),
    _json("/v1/score", Group.pooling),
    _json("/rerank", Group.pooling),
    _json("/v1/rerank", Group.pooling),
    _json("/v2/rerank", Group.pooling),
    # --- tokenizer (/tokenize fetches media from chat messages, so it is inspected) ---
    _json("/tokenize", Group.tokenize),
    _json("/detokenize", Group.tokenize),
    # Not `tokenize`: vLLM 0.32's answer (entrypoints/serve/tokenize) holds the model's
    # path on the engine's disk (`name_or_path`) and its chat template, both operator's
    # knowledge, not a client's; a client tokenizes through /tokenize and /detokenize.
    _get("/tokenizer_info", Group.admin),
    # --- audio: multipart uploads -----------------------------------------------------
    Route("/v1/audio/transcriptions", Action.forward, Group.audio, _POST, BodyKind.multipart),
    Route("/v1/audio/translations", Action.forward, Group.audio, _POST, BodyKind.multipart),
    # --- models and engine info (with a key; open in vLLM) -----------------------------
    # The gateway's merged list of the engines' models (app.py, routing/models.py).
    Route("/v1/models", Action.local, Group.models, _GET),
    _get("/health", Group.info),
    Route("/ping", Action.forward, Group.info, frozenset({"GET", "POST"})),
    # The engine's vLLM version, in the scope of the gateway's own (/gateway/status):
    # it helps nobody but an attacker matching versions to advisories.
    _get("/version", Group.admin),
    _get("/load", Group.info),
    # --- the gateway's own routes ------------------------------------------------------
    Route("/healthz", Action.local, None, _GET),
    Route("/readyz", Action.local, None, _GET),
    Route("/metrics", Action.local, Group.metrics, _GET),
    Route("/gateway/status", Action.local, Group.admin, _GET),
    Route("/gateway/openapi.json", Action.local, Group.admin, _GET),
    # --- blocked: exist on vLLM, never forwarded ----------------------------------------
    _blocked("/v1/load_lora_adapter", _LORA),
    _blocked("/v1/unload_lora_adapter", _LORA),
    _blocked("/adapters", _LORA),
    _blocked("/scale_elastic_ep", _CONTROL),
    _blocked("/is_scaling_elastic_ep", _CONTROL),
    _blocked("/abort_requests", _CONTROL),
    _blocked("/start_profile", _CONTROL),
    _blocked("/stop_profile", _CONTROL),
    _blocked("/collective_rpc", _DEV),
    _blocked("/server_info", _DEV),
    _blocked("/reset_prefix_cache", _DEV),
    _blocked("/reset_mm_cache", _DEV),
    _blocked("/reset_encoder_cache", _DEV),
    _blocked("/sleep", _DEV),
    _blocked("/wake_up", _DEV),
    _blocked("/is_sleeping", _DEV),
    _blocked("/release_kv_cache_memory", _DEV),
    _blocked("/pause", _DEV),
    _blocked("/resume", _DEV),
    _blocked("/is_paused", _DEV),
    _blocked("/init_weight_transfer_engine", _DEV),
    _blocked("/update_weights", _DEV),
    _blocked("/get_world_size", _DEV),
    # vLLM 0.32's online RL routes (vllm/entrypoints/rl/online/api_router.py).
    _blocked("/shutdown_weight_transfer_engine", _WEIGHTS),
    _blocked("/start_weight_update", _WEIGHTS),
    _blocked("/start_draft_weight_update", _WEIGHTS),
    _blocked("/finish_weight_update", _WEIGHTS),
    _blocked("/update_weight_version", _WEIGHTS),
    _blocked("/weight_info", _WEIGHTS),
    _blocked("/weight_checker", _WEIGHTS),
    # Render and derender (vllm/entrypoints/scale_out/, cohere/api_router.py).
    _blocked("/v1/chat/completions/render", _RENDER),
    _blocked("/v1/completions/render", _RENDER),
    _blocked("/v1/messages/render", _RENDER),
    # Listed before the /v1/responses/{id} pattern, which would read "render" as an id.
    _blocked("/v1/responses/render", _RENDER),
    _blocked("/cohere/v2/chat/render", _RENDER),
    _blocked("/v1/chat/completions/derender", _RENDER),
    _blocked("/v1/completions/derender", _RENDER),
    _blocked("/render", _RENDER),
    _blocked("/derender", _RENDER),
    _blocked("/kv_event_sources", _INTERNAL),
    _blocked("/docs", _DOCS),
    _blocked("/docs/oauth2-redirect", _DOCS),
    _blocked("/redoc", _DOCS),
    _blocked("/openapi.json", _DOCS),
    _blocked("/v1/realtime", _REALTIME),
)

TABLE: Final[dict[str, Route]] = {r.path: r for r in _ROUTES}

# Families of blocked routes, by prefix: every path below them is refused with 403.
_BLOCKED_PREFIXES: Final[tuple[tuple[str, str], ...]] = (
    ("/adapters/", _LORA),
    ("/fault_tolerance/", _CONTROL),
    ("/inference/", _INTERNAL),
    # Weight-transfer dev routes: /update_weights_from_..., /get_weight_... and kin.
    ("/update_weights", _DEV),
    ("/init_weight", _DEV),
    ("/get_weight", _DEV),
    ("/sleep", _DEV),
    ("/wake_up", _DEV),
    # The assets of vLLM's offline API docs (`--enable-offline-docs`).
    ("/static/", _DOCS),
)

# Response ids of /v1/responses/{id} and /v1/responses/{id}/cancel.
_RESPONSE_ID = re.compile(r"/v1/responses/([A-Za-z0-9_-]{1,128})(/cancel)?")
# vLLM 0.32's `retrieve_responses(starting_after: int | None, stream: bool | None)`: the
# only forwarded route whose handler reads the query string.
_RESPONSE_GET = Route(
    "/v1/responses/{id}",
    Action.forward,
    Group.inference,
    _GET,
    query=(("stream", QueryValue.boolean), ("starting_after", QueryValue.number)),
)
_RESPONSE_CANCEL = Route("/v1/responses/{id}/cancel", Action.forward, Group.inference, _POST)

UNKNOWN: Final = Route("", Action.unknown)

# The alphabet of canonical paths: lower case letters, digits, `_`, `-`, `.` and `/`.
# Response ids may carry upper case, so case is checked against the table separately.
_CANONICAL = re.compile(rb"(/[A-Za-z0-9_.-]+)+")


@dataclass(frozen=True, slots=True)
class Match:
    """A route matched to a request path. `path` is what is forwarded."""

    route: Route
    path: str


def _lookup(path: str) -> Match:
    route = TABLE.get(path)
    if route is not None:
        return Match(route, path)
    m = _RESPONSE_ID.fullmatch(path)
    if m is not None:
        return Match(_RESPONSE_CANCEL if m.group(2) else _RESPONSE_GET, path)
    for prefix, reason in _BLOCKED_PREFIXES:
        if path.startswith(prefix):
            return Match(_blocked(prefix, reason), path)
    return Match(UNKNOWN, path)


def stored_response_id(route: Route, path: str) -> str | None:
    """The response id a `/v1/responses/{id}` route names in `path` (the matched one);
    None for any other route."""
    if route is not _RESPONSE_GET and route is not _RESPONSE_CANCEL:
        return None
    m = _RESPONSE_ID.fullmatch(path)
    return None if m is None else m.group(1)


def canonical_form(raw_path: bytes) -> str:
    """The path a lenient server could read `raw_path` as: decoded, `;` parameters
    dropped, empty and dot segments resolved, lower case, no trailing slash."""
    decoded = raw_path
    # Decode repeatedly: a double-encoded `%252e` must not hide a dot segment.
    for _ in range(3):
        nxt = unquote_to_bytes(decoded)
        if nxt == decoded:
            break
        decoded = nxt
    text = decoded.replace(b"\x00", b"").replace(b"\\", b"/").decode("latin-1").lower()
    parts: list[str] = []
    for segment in text.split("/"):
        segment = segment.split(";", 1)[0]
        if segment in ("", "."):
            continue
        if segment == "..":
            if parts:
                parts.pop()
            continue
        parts.append(segment)
    return "/" + "/".join(parts)


# The table's own paths, as a client sends them: each is canonical and in the table, so
# `match` would find it there; looked up first, one dict access instead of the checks.
_EXACT: Final[dict[bytes, Match]] = {
    path.encode("ascii"): Match(route, path) for path, route in TABLE.items()
}


def match(raw_path: bytes) -> Match:
    """Classify a raw request path (without its query string)."""
    exact = _EXACT.get(raw_path)
    if exact is not None:
        return exact
    if _CANONICAL.fullmatch(raw_path) and b"/./" not in raw_path + b"/":
        path = raw_path.decode("ascii")
        if "/../" not in path + "/":
            found = _lookup(path)
            if found.route.action is not Action.unknown:
                return found
    # Not canonical, or not in the table: a blocked canonical form stays blocked,
    # anything else is unknown. Nothing here is ever forwarded.
    canonical = _lookup(canonical_form(raw_path))
    if canonical.route.action is Action.blocked:
        return canonical
    return Match(UNKNOWN, canonical.path)


def _query_value(kind: QueryValue, raw: bytes) -> str | None:
    """The form of `raw` forwarded for a parameter of `kind`, or None if it is not one."""
    if kind is QueryValue.boolean:
        return _BOOLEANS.get(raw.decode("latin-1").lower())
    if _COUNT.fullmatch(raw):
        return str(int(raw))
    return None


def forwarded_query(route: Route, raw: bytes) -> str:
    """The query string forwarded for `route`, rebuilt from the checked values ("" for
    none), from the raw one the client sent. Names and values are compared as sent: a
    percent-escaped name is not the name, and no declared value needs escaping. An
    undeclared, repeated or malformed parameter is refused (400): the engine's parser
    would read something (the last of repeated names, a decoded escape) that this check
    did not."""
    if not raw:
        return ""
    declared = dict(route.query)
    seen: dict[str, str] = {}
    for item in raw.split(b"&"):
        name_bytes, sep, value = item.partition(b"=")
        name = name_bytes.decode("latin-1")
        kind = declared.get(name)
        if kind is None:
            allowed = ", ".join(declared) or "none"
            raise FieldNotAllowed(
                f"This endpoint does not take this query parameter (it takes: {allowed}).",
                param="query",
            )
        if name in seen:
            raise InvalidRequest(f"The query parameter '{name}' is repeated.", param=name)
        checked = _query_value(kind, value) if sep else None
        if checked is None:
            raise InvalidRequest(
                f"The query parameter '{name}' must be {_EXPECTED[kind]}.", param=name
            )
        seen[name] = checked
    return "&".join(f"{name}={value}" for name, value in seen.items())


_EXPECTED: Final = {
    QueryValue.boolean: "true or false",
    QueryValue.number: "a whole number from 0 to 999999999",
}
