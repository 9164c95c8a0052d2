"""Why an engine is out of rotation: a stable reason and a detail for people.

The checks (checks.py) give each engine a `Verdict` at every health check, and the pool
(pool.py) one when the proxy ejects it; `Engine.reason` is None while it is healthy. A
change of verdict is logged once (`engine_health`), and shows on /readyz (the reason)
and /gateway/status (reason and detail).

Reasons are stable strings, for alerts and scripts:

    not_checked           not checked yet
    connect_refused       nothing listens at the engine's address and port
    connect_timeout       no connection within timeouts.connect
    connect_failed        the connection could not be opened (unreachable, reset)
    name_unresolved       the engine's host name has no address
    tls_failed            TLS handshake failed, or the certificate is not trusted
    timeout               no whole answer within routing.health_timeout
    bad_response          the connection closed, or the answer was not HTTP
    health_status         GET /health answered a status other than 200
    upstream_key_refused  the engine answered 401 or 403: upstream_api_key is wrong or unset
    models_status         GET /v1/models answered a status other than 200
    models_unreadable     GET /v1/models: not JSON, not a model list, or no model in it
    ejected_5xx           taken out of rotation by a run of failed requests across keys
                          (5xx, timeouts, answers broken off; pool.py)
    ejected_connect       taken out of rotation by a connection that failed while forwarding

and for a `dns+http://` entry (pool.EnginePool.dns_reasons, the `engine_dns` line):

    dns_no_addresses      the name has no address: the entry has no engines
    dns_failed            the lookup failed: the engines of the last good one stay

A detail is fixed text with at most a status code, a path of the engine's API, a setting
name or a duration: never the engine's answer, an address or a key, so it can be logged
and shown as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from gateway.upstream.errors import (
    ConnectFailed,
    ConnectRefused,
    ConnectTimeout,
    FirstByteTimeout,
    NameUnresolved,
    ReadTimeout,
    TlsFailed,
    UpstreamError,
)

HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why an engine is not healthy: `reason` (stable) and `detail` (for people)."""

    reason: str
    detail: str


NOT_CHECKED = Verdict("not_checked", "not checked yet")
TIMEOUT = "timeout"
DNS_NO_ADDRESSES = Verdict(
    "dns_no_addresses", "the name has no A or AAAA record: no engine from this entry"
)
DNS_FAILED = Verdict("dns_failed", "the lookup failed: the last good addresses are kept")
MODELS_EMPTY = Verdict("models_unreadable", f"GET {MODELS_PATH} lists no model")

# Why a connection could not be opened, most specific class first.
_CONNECT: tuple[tuple[type[ConnectFailed], str, str], ...] = (
    (ConnectRefused, "connect_refused", "connection refused: nothing listens at the engine's port"),
    (ConnectTimeout, "connect_timeout", "no connection within timeouts.connect"),
    (NameUnresolved, "name_unresolved", "the engine's host name has no address"),
    (
        TlsFailed,
        "tls_failed",
        "the TLS handshake failed or the engine's certificate is not trusted (engine_ca_file)",
    ),
    (ConnectFailed, "connect_failed", "the connection could not be opened"),
)


def connect_verdict(exc: ConnectFailed) -> Verdict:
    """Why connecting failed."""
    for cls, reason, detail in _CONNECT:
        if isinstance(exc, cls):
            return Verdict(reason, detail)
    raise AssertionError("unreachable: ConnectFailed is last")


def error_verdict(exc: UpstreamError | TimeoutError, path: str, limit: float) -> Verdict:
    """A check of `path` that got no answer (within `limit`, routing.health_timeout)."""
    if isinstance(exc, ConnectFailed):
        return connect_verdict(exc)
    if isinstance(exc, TimeoutError | FirstByteTimeout | ReadTimeout):
        return Verdict(TIMEOUT, f"GET {path}: no whole answer within {limit:g} s")
    return Verdict("bad_response", f"GET {path}: the connection closed or the answer was not HTTP")


def status_verdict(path: str, status: int, *, keyed: bool) -> Verdict:
    """A check of `path` answered `status` (not 200); `keyed`: the gateway sends a key."""
    if status in (401, 403):
        setting = (
            "is not the key the engine was started with (--api-key)"
            if keyed
            else "is not set, and the engine requires a key (--api-key)"
        )
        return Verdict(
            "upstream_key_refused",
            f"GET {path} answered {status}: the engine refused the gateway's key; "
            f"the setting upstream_api_key {setting}",
        )
    reason = "health_status" if path == HEALTH_PATH else "models_status"
    return Verdict(reason, f"GET {path} answered {status}")


def unreadable_models(body: bytes) -> Verdict:
    """Why a 200 answer to GET /v1/models is not a model list (model_list.parse_model_list
    returned None)."""
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return Verdict("models_unreadable", f"GET {MODELS_PATH}: the answer is not JSON")
    return Verdict("models_unreadable", f"GET {MODELS_PATH}: the answer has no `data` list")


def ejected_verdict(
    error: UpstreamError | None, *, after_5xx: int | None, backoff: float
) -> Verdict:
    """An engine the proxy took out of rotation for `backoff` seconds: after a run of
    `after_5xx` 5xx answers, or else for a connection that failed (`error`)."""
    if after_5xx is not None:
        return Verdict("ejected_5xx", f"{after_5xx} 5xx answers in a row; back-off {backoff:g} s")
    if isinstance(error, ConnectFailed):
        cause = connect_verdict(error).detail
    elif error is not None:
        cause = "the engine closed a connection unanswered, then a new one failed"
    else:
        cause = "the connection failed"
    return Verdict("ejected_connect", f"while forwarding: {cause}; back-off {backoff:g} s")
