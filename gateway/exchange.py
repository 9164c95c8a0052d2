"""The record of one request as it passes through the gateway.

Each step fills in what it learns (route, key, model, engine, sizes); the
outermost one turns it into the request's log line and metrics.
"""

from __future__ import annotations

from gateway.access.endpoints import UNKNOWN, Route
from gateway.config.key_file import ApiKey
from gateway.types import Scope, Send

# Prompt tokens, completion tokens: what an answer reports it used (proxy/usage.py).
Usage = tuple[int, int]

# The scope key under which the exchange travels.
SCOPE_KEY = "gateway.exchange"


class Exchange:
    """Mutable per-request state. `code` is the error code, or "" on success."""

    __slots__ = (
        "anchor_kind",
        "audio_seconds",
        "bytes_in",
        "bytes_out",
        "client",
        "code",
        "disconnected",
        "engine",
        "engine_request_id",
        "failovers",
        "key",
        "key_name",
        "model",
        "path",
        "policy",
        "request_id",
        "route",
        "send",
        "spilled",
        "started",
        "status",
        "ttfb",
        "usage",
    )

    def __init__(
        self, request_id: str, path: str, started: float, client: str | None = None
    ) -> None:
        self.request_id = request_id
        # The client's address (access/clients.py); None: no IP peer.
        self.client = client
        # The id the engine gets (its request id in vLLM): ours, or the client's made
        # unique (see middleware.Front).
        self.engine_request_id = request_id
        self.path = path
        self.started = started
        self.route: Route = UNKNOWN
        self.key: ApiKey | None = None
        # Set when a key was recognised, even on a refused request.
        self.key_name: str | None = None
        self.model: str | None = None
        self.engine: str | None = None
        self.status = 0
        self.code = ""
        self.bytes_in = 0
        self.bytes_out = 0
        self.ttfb: float | None = None
        self.disconnected = False
        # The routing decision, when a policy chose among several engines: its name,
        # the anchor's kind, whether the request left its first choice, and how many
        # refused connections moved it on.
        self.policy: str | None = None
        self.anchor_kind: str | None = None
        self.spilled: bool | None = None
        self.failovers = 0
        # The tokens the engine's answer reported (gateway/proxy/usage.py); None: none.
        self.usage: Usage | None = None
        # Seconds of audio a transcription or translation is metered (proxy/metering.py:
        # `Metering.audio_seconds`); None: none.
        self.audio_seconds: float | None = None
        # The server's own `send`, for a response's body once its start went through the
        # gateway's (middleware.Front: the status, X-Request-Id); None: that one.
        self.send: Send | None = None


def exchange_of(scope: Scope) -> Exchange:
    ex: Exchange = scope[SCOPE_KEY]
    return ex
