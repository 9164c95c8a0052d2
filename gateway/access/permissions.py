"""Authorisation in one place: whether a key may use a route, and a model.

The route check runs in `middleware.Front`, as soon as the key is known;
the request check in the proxy, once the body that names the model has been read. vLLM
takes the model from the JSON `model`, from a multipart `model` field (resolved the
same way: unknown names go on to the LoRA resolvers), and on `/invocations` from a
header (below); each is checked here.
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.access.endpoints import Group, Route
from gateway.config.key_file import ApiKey
from gateway.errors import (
    EndpointBlocked,
    FieldNotAllowed,
    ModelNotAllowed,
    ModelNotFound,
    ModelRequired,
    NoEngineAvailable,
    PermissionDenied,
)
from gateway.exchange import Exchange
from gateway.payload.settings import CacheIsolation, PayloadSettings
from gateway.routing.models import ModelIndex

# vLLM's SageMaker wrapper: its body `model` is replaced before vLLM reads it.
_INVOCATIONS = "/invocations"
# Scopes a route needs beyond its group's. vLLM 0.32 dispatches /invocations by the
# body's shape to its chat, completion, embedding, classification and scoring handlers.
_ALSO_REQUIRED: dict[str, frozenset[Group]] = {_INVOCATIONS: frozenset({Group.pooling})}
# Routes without a body that describe the engine's default model (its tokenizer and
# chat template): they follow the rules of a request that names no model.
_DEFAULT_MODEL_ROUTES = frozenset({"/tokenizer_info"})
# Routes whose requests reach the engine without `cache_salt` (vLLM 0.32: Cohere chat
# builds its chat request without it; Cohere embed and the speech-to-text requests have
# no such field), so the gateway cannot keep tenants' prefix caches apart there.
_UNSALTED = frozenset(
    {"/cohere/v2/chat", "/v2/embed", "/v1/audio/transcriptions", "/v1/audio/translations"}
)


def check_route(key: ApiKey, route: Route) -> None:
    """The key's scopes must grant the route's group, and any other the route needs."""
    group = route.group
    if group is not None and group not in key.scopes:
        raise PermissionDenied(f"This API key has no '{group.value}' scope.")
    also = _ALSO_REQUIRED.get(route.path)
    if also is not None and not also <= key.scopes:
        needed = ", ".join(sorted(g.value for g in also | {group} if g is not None))
        raise PermissionDenied(f"This endpoint needs the scopes: {needed}.")


class Form(Protocol):
    """A validated multipart upload (proxy/multipart.py's `Upload`)."""

    @property
    def model(self) -> str | None: ...


class Body(Protocol):
    """A request's body as read (proxy/body.py's `Incoming`)."""

    @property
    def json(self) -> dict[str, Any] | None: ...
    @property
    def upload(self) -> Form | None: ...


class Models(Protocol):
    """Where the served models are known (routing/pool.py's `EnginePool`)."""

    @property
    def index(self) -> ModelIndex: ...


class RequestCheck:
    """What a request's body asks for must be allowed: the model for its key, and a
    route that keeps tenants' caches apart when the deployment isolates them. Calling
    it gives the model whose engines may take the request (routing/models.py)."""

    def __init__(self, models: Models, payload: PayloadSettings) -> None:
        self.models = models
        self.isolated = payload.cache_isolation is not CacheIsolation.off

    def route(self, ex: Exchange) -> None:
        """Checks that need no body: run before it is read."""
        if self.isolated and ex.route.path in _UNSALTED:
            raise EndpointBlocked(
                "This endpoint cannot keep tenants' prefix caches apart (the engine drops "
                "cache_salt there), and this gateway isolates them."
            )

    def __call__(self, ex: Exchange, incoming: Body) -> str | None:
        """The model the request runs on, or None for a route without a body that is
        about an engine or what it stores rather than a model (`/health`, `/version`,
        `/v1/responses/{id}` ...): any healthy engine takes it."""
        if incoming.json is not None:
            if ex.route.path == _INVOCATIONS:
                return self._invocation(ex, incoming.json)
            return self._model(ex, incoming.json.get("model"))
        if incoming.upload is not None:
            return self._model(ex, incoming.upload.model)
        if ex.route.path in _DEFAULT_MODEL_ROUTES:
            return self._model(ex, None)
        return None

    def _invocation(self, ex: Exchange, body: dict[str, Any]) -> str:
        """`/invocations`: vLLM 0.32 serves it under `model_hosting_container_standards`
        (0.1.16), whose `inject_adapter_id(adapter_path="model")` sets the body's `model`
        to the `X-Amzn-SageMaker-Adapter-Identifier` header, or to null when the header
        is absent, before vLLM reads the body. The gateway never forwards that header
        (proxy/headers.py), so vLLM always runs its default model there, whatever the body
        names: a key limited to some models cannot be held to them and is refused, and
        the request goes to the engines of the default model.
        Stateful-session requests (`requestType`) are the wrapper's, not inference."""
        if "requestType" in body:
            raise FieldNotAllowed(
                "SageMaker session requests are not served through this gateway.",
                param="requestType",
            )
        key = ex.key
        if key is not None and key.models is not None:
            raise ModelNotAllowed(
                "This API key may use only some models, and /invocations always runs the "
                "engine's default model: use the OpenAI-compatible routes."
            )
        model = body.get("model")
        if model is not None:
            self._model(ex, model)
        return self._default(
            ex,
            "/invocations runs each engine's default model, and these engines' defaults "
            "differ: use the OpenAI-compatible routes and name the model.",
        )

    def _model(self, ex: Exchange, model: Any) -> str:
        """`model` (None when absent) must be served and allowed for the key; a key
        limited to some models must name one. Without one, the engines' default model,
        where that is unambiguous."""
        key = ex.key
        if model is None:
            # vLLM then runs its default model; a key limited to some models must name one.
            if key is not None and key.models is not None:
                raise ModelRequired("This API key may use only some models: name one in 'model'.")
            return self._default(
                ex, "The engines behind this gateway serve different models: name one in 'model'."
            )
        # Not a string, or not the key's: the same answer as a model nobody serves, and
        # decided before the pool is consulted, so a key cannot tell which it was.
        if not isinstance(model, str) or (key is not None and not key.allows_model(model)):
            raise ModelNotFound(model)
        index = self.models.index
        if not index.known:
            # No engine has listed its models yet (they are all down or starting): the
            # model may well be served, so "retry shortly", not "not found".
            raise NoEngineAvailable()
        if model not in index.served:
            raise ModelNotFound(model)
        ex.model = model
        return model

    def _default(self, ex: Exchange, ambiguous: str) -> str:
        """The default model of every engine whose models are known; `ambiguous` is the
        message when they differ."""
        index = self.models.index
        if not index.known:
            raise NoEngineAvailable()
        if index.default is None:
            raise ModelRequired(ambiguous)
        ex.model = index.default
        return index.default
