"""The one error tree of the gateway (rendered in one place: gateway/responses.py).

Every refusal the gateway makes is a `GatewayError` subclass with a fixed HTTP status
and a stable `code` that clients and tests can rely on. Foreign exceptions (httpx,
httptools, Pillow, orjson) are translated at the boundary with ``raise ... from exc``;
their text never reaches a client, because Pillow messages have leaked heap addresses
and URL parsers echo attacker input. Raised when:

* GatewayError                500 internal_error: an unexpected failure (middleware.py)
  + InvalidRequest            400 invalid_request: a body the rules refuse (payload/), a
  |                           query parameter's value (access/endpoints.py)
  | + InvalidJson             400 invalid_json: a body not JSON, or not an object (proxy/body.py)
  | + ModelRequired           400 model_required: no `model` where the engines' default
  | |                         model is ambiguous, or from a key limited to some models
  | |                         (access/permissions.py)
  | + BodyChunksTooSmall      400 body_chunks_too_small: a chunked body in chunks too small
  | |                         on average, written by the connection (server/protocol.py), which
  | |                         then closes
  | + FieldNotAllowed         400 field_not_allowed: a field or form field (payload/), or a
  | |                         query parameter (access/endpoints.py), refused
  | + MediaUrlNotAllowed      400 media_url_not_allowed: a media URL off policy (media/)
  | + MediaInvalid            400 media_invalid: a media item not valid (media/, payload/)
  | + MediaNotIsolated        400 media_not_isolated: media where the engine cannot be given
  |                           a per-tenant name for it, while payload.cache_isolation is on
  |                           (payload/inspector.py)
  + InvalidApiKey             401 invalid_api_key: no key, not Bearer, unknown (access/api_keys.py)
  + PermissionDenied          403 scope_not_allowed: the key lacks the route's group
  | + EndpointBlocked         403 endpoint_blocked: a blocked route (middleware.py)
  | + ModelNotAllowed         403 model_not_allowed: /invocations (which runs the engine's
  |                           default model) from a key limited to some models
  + UnknownEndpoint           404 unknown_endpoint: a path not in the table
  + ModelNotFound             404 model_not_found: a model no engine serves, or one the
  |                           key may not use: the same answer, so keys cannot probe
  + ResponseNotFound          404 response_not_found: a stored response id (a path's, or
  |                           a body's `previous_response_id`) this key did not create
  |                           through the gateway (payload/fields.py, proxy/handler.py):
  |                           the same answer for an id that does not exist
  + MethodNotAllowed          405 method_not_allowed: the wrong method for a route
  + RequestTimeout            408 request_timeout: a body too slow or past its deadline
  |                           (proxy/body.py); the connection is closed
  + RequestTooLarge           413 request_too_large: a body over its cap (proxy/body.py), or
  | |                         one that alone would hold more than a key's body budget
  | |                         (proxy/budget.py)
  | + MediaTooLarge           413 media_too_large: a media item over its caps (media/)
  |   + MediaDurationUnknown  413 media_duration_unknown: an audio or video item whose
  |                           headers do not say how long it plays (media/av.py)
  + TooManyHeaders            431 too_many_headers: over limits.max_headers
  + HeadersTooLarge           431 headers_too_large: a head over limits.max_header_bytes,
  |                           written by the connection (server/protocol.py), which then closes
  + UnsupportedMediaType      415 unsupported_media_type: a Content-Type the route refuses
  + MediaFetchFailed          422 media_fetch_failed: a media URL could not be fetched
  + RateLimited               429 rate_limited: over the key's in-flight cap or its rate
  | |                         limit (access/admission.py)
  | + TooManyFailures         429 too_many_failures: a client address past its failed
  | |                         authentications in the window (access/throttle.py)
  | + TooManyEngineErrors     429 too_many_engine_errors: a key whose requests the engines
  | |                         answered 5xx too often in the window (routing/key_errors.py)
  | + TooManyBodyBytes        429 too_many_body_bytes: a key's request bodies held in
  |                           memory past limits.max_buffered_body_bytes_per_key
  |                           (proxy/budget.py)
  + Overloaded                503 overloaded: over limits.max_in_flight (access/admission.py),
  | |                         or over limits.max_buffered_body_bytes (proxy/budget.py)
  | + NoEngineAvailable       503 no_engine_available: no engine, no healthy engine (for
  | |                         a route about an engine, not a model), or no models known yet
  | + ModelUnavailable        503 model_unavailable: every engine serving the model is
  | |                         down (failed its checks, or ejected); nothing was sent
  | + MediaBusy               503 media_busy: no room in the media decode budget (or no
  | |                         decode thread) within media.decode_wait (media/decoder.py)
  | + LimitsUnavailable       503 limits_unavailable: a key's shared limit could not be
  |                           checked (the store down) and its `*_when_store_down` is
  |                           `refuse` (access/admission.py)
  + UpstreamUnavailable       502 upstream_unavailable: no engine took the request
  | + UpstreamBroken          502 upstream_broken: an answer broke off (proxy/forward.py)
  + EngineError               engine's status, engine_error: an engine's 5xx or unusable
  |                           4xx, replaced (proxy/relay.py)
  + UpstreamTimeout           504 upstream_timeout: an engine silent too long (proxy/forward.py)

The upstream client's own failures (gateway/upstream/errors.py, `UpstreamError`) are mapped to
the last four in one place, `gateway_error` (gateway/proxy/forward.py).
"""

from __future__ import annotations

from collections.abc import Mapping


class GatewayError(Exception):
    """Base of every client-facing error. `message` must never carry library text."""

    status: int = 500
    code: str = "internal_error"
    type: str = "server_error"
    default_message: str = "The gateway failed to handle the request."

    def __init__(
        self,
        message: str | None = None,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        super().__init__(self.message)


# --- 4xx: the client's request was refused -------------------------------------------


class InvalidRequest(GatewayError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"
    default_message = "The request is not valid."


class TooManySequences(InvalidRequest):
    """A request that makes the engine run more sequences (prompts x `n`, batch items)
    than one request may, or than the key's in-flight cap or burst hold: it can never
    be admitted as it is, so it is not a 429."""

    code = "too_many_sequences"
    default_message = "The request asks for more engine sequences than this gateway accepts."


class InvalidJson(InvalidRequest):
    code = "invalid_json"
    default_message = "The request body is not a valid JSON object."


class BodyChunksTooSmall(InvalidRequest):
    code = "body_chunks_too_small"
    default_message = "The request body's chunks are too small; send larger chunks."


class FieldNotAllowed(InvalidRequest):
    code = "field_not_allowed"
    default_message = "The request carries a field this gateway does not allow."


class MediaUrlNotAllowed(InvalidRequest):
    code = "media_url_not_allowed"
    default_message = "The media URL is not allowed by this gateway's policy."


class MediaInvalid(InvalidRequest):
    code = "media_invalid"
    default_message = "The media item is not valid."


class MediaNotIsolated(InvalidRequest):
    """Media the engine would cache under a name every tenant shares (its bytes' hash),
    while the gateway keeps tenants' caches apart: a request that could show whether
    another tenant sent the same item. Depends on the body, not the route, so not 403
    `endpoint_blocked`: the same route takes the media in a part that can be named."""

    code = "media_not_isolated"
    default_message = (
        "This gateway keeps tenants' media apart in the engine's caches, and media here "
        "cannot be named per tenant."
    )


class ModelRequired(InvalidRequest):
    code = "model_required"
    default_message = "Name a model in 'model'."

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, param="model")


class InvalidApiKey(GatewayError):
    status = 401
    code = "invalid_api_key"
    type = "authentication_error"
    default_message = "A valid API key is required: send it as 'Authorization: Bearer <key>'."

    def __init__(self, message: str | None = None, *, param: str | None = None) -> None:
        super().__init__(message, param=param, headers={"WWW-Authenticate": "Bearer"})


class PermissionDenied(GatewayError):
    status = 403
    code = "scope_not_allowed"
    type = "permission_error"
    default_message = "This API key may not use this endpoint."


class EndpointBlocked(PermissionDenied):
    code = "endpoint_blocked"
    default_message = "This endpoint is blocked by the gateway."


class ModelNotAllowed(PermissionDenied):
    code = "model_not_allowed"
    default_message = "This API key may not use this endpoint with its models."


class UnknownEndpoint(GatewayError):
    status = 404
    code = "unknown_endpoint"
    type = "invalid_request_error"
    default_message = "Unknown endpoint."


class ModelNotFound(GatewayError):
    """OpenAI's answer, word for word, for a model that does not exist and for one the
    key may not use alike. The name is the client's text: echoed only when it is a
    printable string of at most `ECHO_LIMIT` characters."""

    status = 404
    code = "model_not_found"
    type = "invalid_request_error"
    default_message = "The model does not exist or you do not have access to it."
    ECHO_LIMIT = 256

    def __init__(self, model: object) -> None:
        message = None
        if isinstance(model, str) and 0 < len(model) <= self.ECHO_LIMIT and model.isprintable():
            message = f"The model `{model}` does not exist or you do not have access to it."
        super().__init__(message)


class ResponseNotFound(GatewayError):
    """A stored response the key did not create, or one that does not exist: one answer
    for both, so a key cannot probe which ids exist."""

    status = 404
    code = "response_not_found"
    type = "invalid_request_error"
    default_message = "The response does not exist or you do not have access to it."


class MethodNotAllowed(GatewayError):
    status = 405
    code = "method_not_allowed"
    type = "invalid_request_error"
    default_message = "This method is not allowed on this endpoint."


class RequestTimeout(GatewayError):
    status = 408
    code = "request_timeout"
    type = "invalid_request_error"
    default_message = "The request body did not arrive in time."

    def __init__(self, message: str | None = None) -> None:
        # The rest of a body that stalled may still come: the connection cannot carry
        # another request.
        super().__init__(message, headers={"Connection": "close"})


class RequestTooLarge(GatewayError):
    status = 413
    code = "request_too_large"
    type = "invalid_request_error"
    default_message = "The request body is larger than this gateway accepts."


class MediaTooLarge(RequestTooLarge):
    code = "media_too_large"
    default_message = "The media item is larger than this gateway accepts."


class MediaDurationUnknown(MediaTooLarge):
    """Audio or video whose container does not say how long it plays, so it cannot be
    held to `media.max_audio_seconds` / `max_video_seconds` (unless
    `media.allow_unknown_duration`)."""

    code = "media_duration_unknown"
    default_message = "The media item's duration cannot be read from its headers."


class TooManyHeaders(GatewayError):
    status = 431
    code = "too_many_headers"
    type = "invalid_request_error"
    default_message = "The request has more header fields than this gateway accepts."


class HeadersTooLarge(GatewayError):
    status = 431
    code = "headers_too_large"
    type = "invalid_request_error"
    default_message = "The request's header section is larger than this gateway accepts."


class UnsupportedMediaType(GatewayError):
    status = 415
    code = "unsupported_media_type"
    type = "invalid_request_error"
    default_message = "The request's Content-Type is not accepted on this endpoint."


class MediaFetchFailed(GatewayError):
    status = 422
    code = "media_fetch_failed"
    type = "invalid_request_error"
    default_message = "The media URL could not be fetched."


class RateLimited(GatewayError):
    """Carries Retry-After: whole seconds until the key may send again."""

    status = 429
    code = "rate_limited"
    type = "rate_limit_error"
    default_message = "This API key is over its limits; retry shortly."

    def __init__(self, message: str | None = None, *, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class TooManyFailures(RateLimited):
    """A client address with too many failed authentications in the current window
    (access/throttle.py); Retry-After: whole seconds to the window's end."""

    code = "too_many_failures"
    default_message = "Too many failed authentications from this address; retry later."


class TooManyEngineErrors(RateLimited):
    """A key whose requests the engines answered 5xx (501 included) `routing.key_errors`
    times in the current window (routing/key_errors.py); Retry-After: whole seconds to
    the window's end. The key is throttled, not the engine."""

    code = "too_many_engine_errors"
    default_message = "Too many of this key's requests failed at the engine; retry later."


class TooManyBodyBytes(RateLimited):
    """A key whose request bodies, read and not yet at an engine, hold its share of the
    gateway's memory (proxy/budget.py); Retry-After: 1."""

    code = "too_many_body_bytes"
    default_message = "This API key's request bodies hold their share of memory; retry shortly."


# --- 5xx: the gateway or its engines could not answer ---------------------------------


class Overloaded(GatewayError):
    status = 503
    code = "overloaded"
    type = "server_error"
    default_message = "The gateway is at its limit of requests in flight; retry shortly."

    def __init__(self, message: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class NoEngineAvailable(Overloaded):
    code = "no_engine_available"
    default_message = "No healthy engine is available; retry shortly."


class ModelUnavailable(Overloaded):
    code = "model_unavailable"
    default_message = "The engines serving this model are unavailable; retry shortly."


class MediaBusy(Overloaded):
    code = "media_busy"
    default_message = "The gateway is decoding as many images as it can hold; retry shortly."


class LimitsUnavailable(Overloaded):
    code = "limits_unavailable"
    default_message = "This API key's limits cannot be checked now; retry shortly."


class UpstreamUnavailable(GatewayError):
    status = 502
    code = "upstream_unavailable"
    type = "server_error"
    default_message = "The engine could not be reached."


class UpstreamBroken(UpstreamUnavailable):
    code = "upstream_broken"
    default_message = "The engine's response broke off before it was complete."


class EngineError(GatewayError):
    """An engine's error answer that is not relayed as sent: every 5xx, and a 4xx that
    is not JSON (proxy/scrub.py). Keeps the engine's status; the engine's text went
    to the gateway's log under the request id the message names."""

    code = "engine_error"
    type = "server_error"
    default_message = "The engine could not handle the request."

    def __init__(self, status: int, request_id: str) -> None:
        super().__init__(
            f"The engine could not handle the request; its answer is logged under request "
            f"id {request_id}."
        )
        self.status = status
        if status < 500:
            self.type = "invalid_request_error"


class UpstreamTimeout(GatewayError):
    status = 504
    code = "upstream_timeout"
    type = "server_error"
    default_message = "The engine did not answer in time."
