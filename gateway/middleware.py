"""What every HTTP request meets before its handler, in one plain ASGI layer (`Front`):
its context (id, clock, client, log line, metrics), the endpoint table, the key, the
key's share, then the handler: the proxy, the gateway's own routes, or /v1/models.

One coroutine per request, not one per step: every step is a plain call, and each await
the handler makes resumes through one frame here instead of five nested ones.
Refusals are raised as `GatewayError`; `Front` renders them (through
`responses.send_error`, the one renderer) and writes the request's log line.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from gateway.access.admission import Admission
from gateway.access.api_keys import KeyRing
from gateway.access.clients import ClientAddresses
from gateway.access.endpoints import MODELS_PATH, Action, Group, Route, match
from gateway.access.permissions import check_route
from gateway.access.throttle import FailureThrottle
from gateway.config.key_file import ApiKey
from gateway.errors import (
    EndpointBlocked,
    GatewayError,
    InvalidApiKey,
    MethodNotAllowed,
    TooManyHeaders,
    UnknownEndpoint,
)
from gateway.exchange import SCOPE_KEY, Exchange
from gateway.observability.logging import RequestLog
from gateway.observability.metrics import Metrics
from gateway.proxy.body import ClientDisconnected
from gateway.proxy.body import header as _header
from gateway.responses import error_body, send_error
from gateway.types import ASGIApp, Message, Receive, Scope, Send

# A client's X-Request-Id names the request in logs and in the answer; only a short,
# plain token is taken, anything else is replaced.
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_MAX_LOGGED_PATH = 200


def _ms(seconds: float) -> float:
    """`seconds` in milliseconds to the microsecond, half up: `round(x, 3)`'s figure but
    for a tie, at a third of its cost (round formats the float as a string)."""
    return int(seconds * 1_000_000 + 0.5) / 1000


class RequestIds:
    """Random 128-bit request ids. os.urandom is read 4 KiB at a time: one getrandom()
    system call per request is 2% of the gateway's CPU at 64 connections (py-spy). The
    buffer is filled on first use, so processes forked before it never share one."""

    __slots__ = ("_buffer", "_pos")

    def __init__(self) -> None:
        self._buffer = b""
        self._pos = 0

    def new(self) -> str:
        pos = self._pos
        if pos + 16 > len(self._buffer):
            self._buffer = os.urandom(4096)
            pos = 0
        self._pos = pos + 16
        return self._buffer[pos : pos + 16].hex()


class Front:
    """The steps before a request's handler, in order (docs/gateway.md, "Request path"):

    1. Context: a request with more than `max_headers` header fields is refused (431)
       before anything else looks at them, its own X-Request-Id and X-Forwarded-For
       included (its client is then the peer). The request id, its clock and client.
    2. The endpoint table: unknown paths 404, blocked ones 403, wrong methods 405.
    3. Bearer key check and route-group scopes; /healthz and /readyz need no key. With a
       `throttle`, failed authentications are counted per client address, and an address
       past the limit is refused 429 `too_many_failures` before its key is checked, unless
       that key has authenticated from that address before (access/throttle.py).
    4. The key's share: its cap on requests in flight and its rate limit
       (access/admission.py); over either, 429 `rate_limited` with Retry-After. The global
       `max_in_flight` slot is taken later, by the proxy, once the body is in. With a
       store, a key that has limits of its own is admitted through it (one round trip).
    5. The handler: `local` (the control plane) for the gateway's own routes, `models`
       for /v1/models, `proxy` for everything forwarded.
    """

    def __init__(
        self,
        *,
        proxy: ASGIApp,
        local: ASGIApp,
        models: ASGIApp,
        metrics: Metrics,
        logger: Any,
        request_log: RequestLog,
        max_headers: int,
        keyring: KeyRing,
        admission: Admission,
        public_metrics: bool = False,
        throttle: FailureThrottle | None = None,
        clients: ClientAddresses | None = None,
    ) -> None:
        self.proxy = proxy
        self.local = local
        self.models = models
        self.metrics = metrics
        self.log = logger
        self.request_log = request_log
        self.max_headers = max_headers
        self.keyring = keyring
        self.admission = admission
        self.public_metrics = public_metrics
        self.throttle = throttle
        self.clients = clients or ClientAddresses()
        self.ids = RequestIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        too_many = len(scope["headers"]) > self.max_headers
        given = None if too_many else _header(scope, b"x-request-id")
        own = given is not None and _REQUEST_ID.fullmatch(given) is not None
        request_id = given.decode("ascii") if own and given is not None else self.ids.new()
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8", "replace")
        client = self.clients.of(scope, forwarded=not too_many)
        ex = Exchange(request_id, raw_path.decode("latin-1")[:_MAX_LOGGED_PATH], started, client)
        if own:
            # vLLM takes X-Request-Id as its request id, ahead of the body's, and aborts
            # by it: a client's own id is made unique, so no tenant can name another's
            # request. The engine's id still starts with the client's, for the logs.
            ex.engine_request_id = f"{request_id}-{self.ids.new()[:16]}"
        scope[SCOPE_KEY] = ex
        ex.send = send
        id_header = (b"x-request-id", request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                ex.status = message["status"]
                message["headers"] = [*message["headers"], id_header]
            await send(message)

        try:
            if too_many:
                raise TooManyHeaders()
            app = self._route(scope, raw_path, ex)
            route = ex.route
            group = route.group
            if group is None or (group is Group.metrics and self.public_metrics):
                await app(scope, receive, send_with_id)
                return
            try:
                key = self._authenticate(scope, ex)
            except InvalidApiKey:
                if self.throttle is not None and client is not None:
                    refusal = await self.throttle.failed(client)
                    if refusal is not None:
                        raise refusal from None
                raise
            check_route(key, route)
            if group is Group.metrics:
                # The gateway's own metrics are not counted; /v1/models, answered by the
                # gateway too, is an API call of the key's like any other.
                await app(scope, receive, send_with_id)
                return
            admission = self.admission
            if admission.shared is not None and admission.shares(key):
                lease = await admission.enter_shared(key)
                try:
                    await app(scope, receive, send_with_id)
                finally:
                    admission.leave_shared(key, lease)
                return
            admission.enter_key(key)
            try:
                await app(scope, receive, send_with_id)
            finally:
                admission.leave_key(key)
        except GatewayError as exc:
            ex.code = exc.code
            if ex.status == 0:
                await send_error(send_with_id, exc)
                ex.bytes_out = len(error_body(exc))
        except ClientDisconnected:
            ex.disconnected = True
        except Exception:
            ex.code = "internal_error"
            self.log.exception("unhandled_error", request_id=request_id)
            if ex.status == 0:
                await send_error(send_with_id, GatewayError())
        finally:
            self._finish(scope, ex)

    def _route(self, scope: Scope, raw_path: bytes, ex: Exchange) -> ASGIApp:
        """The handler of the request's route (step 2), or the refusal."""
        found = match(raw_path)
        route: Route = found.route
        ex.route = route
        action = route.action
        if action is Action.forward or action is Action.local:
            if scope["method"] not in route.methods:
                raise MethodNotAllowed(f"{route.path} accepts {', '.join(sorted(route.methods))}.")
            scope["gateway.path"] = found.path
            if action is Action.forward:
                return self.proxy
            return self.models if route.path == MODELS_PATH else self.local
        # Refused without being forwarded. The key's name, if it is a valid key, goes
        # into the log line so an operator can see who probed a blocked route.
        ex.key_name = self.keyring.identify(_header(scope, b"authorization"))
        if action is Action.blocked:
            raise EndpointBlocked(f"This endpoint is blocked by the gateway: {route.reason}.")
        raise UnknownEndpoint("Unknown endpoint: this path is not served by the gateway.")

    def _authenticate(self, scope: Scope, ex: Exchange) -> ApiKey:
        """The request's key (step 3), on `ex` too; raises the throttle's refusal or
        InvalidApiKey (the caller counts the failure)."""
        authorization = _header(scope, b"authorization")
        throttle = self.throttle
        client = ex.client
        if throttle is None or client is None:
            key = self.keyring.authenticate(authorization)
        else:
            # A request without a key where none is needed tries no key.
            if (
                throttle.over(client)
                and (authorization is not None or not self.keyring.allow_unauthenticated)
                and not throttle.known(client, authorization)
            ):
                raise throttle.refuse(client)
            key = self.keyring.authenticate(authorization)
            throttle.succeeded(client, key.digest)
        ex.key = key
        ex.key_name = key.name
        return key

    def _finish(self, scope: Scope, ex: Exchange) -> None:
        duration = time.perf_counter() - ex.started
        if ex.disconnected:
            ex.code = ex.code or "client_disconnected"
            # 499: nginx's "client closed request"; the client saw nothing.
            ex.status = ex.status or 499
        group = ex.route.label
        rejected = ex.engine is None and ex.code != ""
        self.metrics.observe_request(group, ex.status, ex.code, duration, rejected, ex.key_name)
        if ex.usage is not None:
            self.metrics.observe_usage(ex.key_name, *ex.usage)
        if ex.audio_seconds is not None:
            self.metrics.observe_audio(ex.key_name, ex.audio_seconds)
        self.request_log.write(
            {
                "request_id": ex.request_id,
                "engine_request_id": ex.engine_request_id,
                "key_name": ex.key_name,
                "client": ex.client,
                "method": scope["method"],
                "path": ex.path,
                "group": group,
                "model": ex.model,
                "engine": ex.engine,
                "policy": ex.policy,
                "anchor_kind": ex.anchor_kind,
                "spilled": ex.spilled,
                "failovers": ex.failovers,
                "status": ex.status,
                "code": ex.code or None,
                "bytes_in": ex.bytes_in,
                "bytes_out": ex.bytes_out,
                "ttfb_ms": None if ex.ttfb is None else _ms(ex.ttfb),
                "duration_ms": _ms(duration),
            }
        )
