"""The innermost ASGI app: one forwarded request, from its body to the engine's answer.

    read the body (proxy/body.py) -> take a global slot (access/admission.py)
    -> check the model (access/permissions.py) and take its healthy engines (routing/models.py)
    -> inspect it (payload/) -> order those engines (routing/policy.py)
    -> forward with failover (proxy/forward.py)
    -> relay the answer (proxy/relay.py), watching for the client leaving (proxy/disconnect.py)

Requests go out through an `UpstreamClient` (gateway/upstream/interfaces.py; the real one,
and why not aiohttp or httpx: gateway/upstream/client.py), which the app hands in: tests
give it a fake engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

import orjson

from gateway.access.admission import Admission
from gateway.access.endpoints import RESPONSES_PATH, forwarded_query, stored_response_id
from gateway.access.permissions import RequestCheck
from gateway.config.settings import Settings
from gateway.errors import ModelUnavailable, NoEngineAvailable, ResponseNotFound
from gateway.exchange import Exchange, exchange_of
from gateway.observability.metrics import Metrics
from gateway.payload.inspector import PayloadInspector
from gateway.payload.sequences import sequences, speech
from gateway.proxy.body import ClientDisconnected, Incoming, header, read_incoming
from gateway.proxy.budget import BodyBudget
from gateway.proxy.disconnect import DisconnectWatch
from gateway.proxy.forward import Forwarder
from gateway.proxy.headers import request_allowlist
from gateway.proxy.metering import plan
from gateway.proxy.relay import Relay
from gateway.routing.engine import Engine
from gateway.routing.key_errors import KeyErrors
from gateway.routing.policy import Policy, RoutingRequest
from gateway.routing.pool import EnginePool
from gateway.server.limits import ConnectionGuard
from gateway.types import Receive, Scope, Send
from gateway.upstream.interfaces import Response, UpstreamClient


class Proxy:
    """Forwards an authorised request to an engine and relays the answer."""

    def __init__(
        self,
        settings: Settings,
        pool: EnginePool,
        policy: Policy,
        metrics: Metrics,
        inspector: PayloadInspector,
        upstream: UpstreamClient,
        admission: Admission,
        connections: ConnectionGuard,
        *,
        engine_auth: Sequence[tuple[bytes, bytes]],
        key_errors: KeyErrors | None = None,
    ) -> None:
        self.settings = settings
        self.connections = connections
        self._admission = admission
        limits = settings.limits
        # What request bodies hold in this process, from their first byte until the
        # engine has them (proxy/budget.py).
        self.bodies = BodyBudget(
            limits.max_buffered_body_bytes, limits.max_buffered_body_bytes_per_key
        )
        self._slot = admission.slot()
        self.inspector = inspector
        self.pool = pool
        self.policy = policy
        self.check_request = RequestCheck(pool, settings.payload)
        # A key whose requests keep failing at the engine is throttled, not the engine.
        self.key_errors = key_errors
        self.forwarder = Forwarder(upstream, pool, metrics, key_errors)
        self.relay = Relay(settings.timeouts.idle, settings.timeouts.left_grace)
        self._counts = metrics.routing
        # The engine's own key (app.py builds it), after the client's headers.
        self._auth_header = list(engine_auth)
        self._forwarded = request_allowlist(settings.forward_headers)
        header_name = settings.routing.session_header
        # ASGI header names are lowercase bytes.
        self._session_header = (
            header_name.strip().lower().encode("latin-1") if header_name else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex = exchange_of(scope)
        self.check_request.route(ex)
        if self.key_errors is not None:
            # Before the body: a throttled key costs no read and reaches no engine.
            self.key_errors.check(ex.key_name)
        # Checked before the body is read; only the checked parameters are forwarded.
        query = forwarded_query(ex.route, scope.get("query_string", b""))
        response_id = stored_response_id(ex.route, scope["gateway.path"])
        if response_id is not None and not self.inspector.owns_response(ex.key, response_id):
            # Another key's stored response, or one not made through the gateway.
            raise ResponseNotFound(param="response_id")
        charge = self.bodies.charge(b"" if ex.key is None else ex.key.digest)
        incoming: Incoming | None = None
        sequences_charge = None
        try:
            incoming = await read_incoming(
                scope, receive, ex, self.settings, self.connections, charge
            )
            ex.bytes_in = incoming.size
            # The key was charged one engine sequence at authentication; the rest of
            # what the body asks for (prompts x n, batch items) now, before any media
            # is fetched.
            if ex.key is not None:
                upload = incoming.upload
                if upload is None:
                    weight, param = sequences(ex.route.path, incoming.json)
                else:
                    # Its form fields and the file's playing time (`Upload.seconds`).
                    media = self.settings.media
                    weight, param = speech(
                        upload.fields,
                        upload.seconds,
                        clip_seconds=media.audio_clip_seconds,
                        max_seconds=media.max_audio_seconds,
                    )
                if weight > 1:  # most requests: no coroutine made
                    sequences_charge = await self._admission.charge(ex.key, weight, param)
            # Counted against max_in_flight from here: a body still arriving holds no slot.
            with self._slot:
                await self._serve(
                    scope, receive, send, ex, incoming, query, response_id is not None
                )
        finally:
            if sequences_charge is not None:
                self._admission.refund(sequences_charge)
            if incoming is not None:
                incoming.drop()
            charge.close()

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ex: Exchange,
        incoming: Incoming,
        query: str,
        stored: bool,
    ) -> None:
        """Everything after the body, holding a global slot. The body's parts are
        dropped as soon as they are not needed: the parsed object once the engines are
        ordered, the bytes once the engine has them (its answer starts)."""
        engines = self._engines(ex, incoming)
        # What the engine is asked for so that its answer can be metered (proxy/metering.py).
        upload = incoming.upload
        meter, asked = plan(
            ex.route,
            incoming.json,
            stored,
            seconds=None if upload is None else upload.seconds,
            unknown_seconds=self.settings.media.max_audio_seconds,
        )
        media = await self._inspect(incoming, ex, asked)
        if len(engines) == 1:
            # One candidate (the sidecar deployment): there is nothing to choose, so no
            # anchor is computed. The policy cost 9% of the CPU per request (py-spy).
            order: Sequence[Engine] = engines
        else:
            order = await self._choose(scope, ex, incoming, media, engines)
        incoming.drop_json()
        target: str = scope["gateway.path"]
        if query:
            target += "?" + query
        headers = self._upstream_headers(scope, ex.engine_request_id, incoming.content_type)

        # The loop the lifespan bound (gateway/app.py), kept by the connection guard.
        loop = self.connections.running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        # The body is consumed: from now on `receive` only reports a disconnect. A
        # metered request whose client leaves before its answer starts goes on at the
        # engine, to be metered what the engine made (proxy/relay.py reads it unrelayed).
        watch = DisconnectWatch(loop, receive, ex, task, hold=meter.count)

        def relay(resp: Response) -> Awaitable[None]:
            # The engine answers: it has the body, which the forwarder has dropped.
            incoming.drop()
            return self.relay(resp, send, ex, watch, meter)

        try:
            # The bytes handed over, not kept in a local: the forwarder drops them once
            # the engine has them.
            await self.forwarder.forward(
                ex, order, scope["method"], target, headers, incoming.take_data(), relay
            )
        except asyncio.CancelledError:
            if not ex.disconnected:
                raise
            # The client left: the upstream request was closed (the engine aborts it).
            task.uncancel()
        except ClientDisconnected:
            ex.disconnected = True
        finally:
            watch.stop()

    def _engines(self, ex: Exchange, incoming: Incoming) -> Sequence[Engine]:
        """The engines that may take the request: the healthy ones serving its model
        (failover never leaves them), any healthy one for a route about an engine. Known
        before the body is inspected, so a request no engine can take fetches no media."""
        pool = self.pool
        if not pool.engines:
            raise NoEngineAvailable("No engine is configured.")
        model = self.check_request(ex, incoming)
        if model is None:
            engines: Sequence[Engine] = pool.healthy()
            if not engines:
                raise NoEngineAvailable()
            return engines
        engines = pool.index.engines(model)
        if not engines:
            raise ModelUnavailable()
        return engines

    async def _inspect(self, incoming: Incoming, ex: Exchange, changed: bool) -> dict[str, str]:
        """The content hashes of the body's media items (for routing); a body the
        inspector rewrote replaces the client's bytes in `incoming` (charged). The single
        place where request bodies are inspected or rewritten before they reach an
        engine. A body the inspector did not rewrite (no media, no client identifier to
        namespace, nothing asked for metering: `changed`) is forwarded as the client
        sent it."""
        body = incoming.json
        if body is None:
            return {}
        creates_response = ex.route.path == RESPONSES_PATH
        inspection = await self.inspector.inspect(body, ex.key, creates_response=creates_response)
        if inspection.changed or changed:
            incoming.replace_data(orjson.dumps(body))
        return dict(inspection.media)

    def _upstream_headers(
        self, scope: Scope, request_id: str, content_type: tuple[bytes, bytes] | None
    ) -> list[tuple[bytes, bytes]]:
        """The headers an engine gets: the checked Content-Type, the client's headers on
        the allowlist (proxy/headers.py), our request id and the engine key. The client's
        Authorization, Connection and every header vLLM acts on stay behind."""
        headers: list[tuple[bytes, bytes]] = [] if content_type is None else [content_type]
        forward = self._forwarded
        for name, value in scope["headers"]:
            if name in forward:
                headers.append((name, value))
        headers.append((b"x-request-id", request_id.encode("ascii")))
        headers.extend(self._auth_header)
        return headers

    async def _choose(
        self,
        scope: Scope,
        ex: Exchange,
        incoming: Incoming,
        media: dict[str, str],
        engines: Sequence[Engine],
    ) -> list[Engine]:
        """The policy's order for this request; its decision goes on `ex` and the counts."""
        session: str | None = None
        if self._session_header is not None:
            value = header(scope, self._session_header)
            if value:
                session = value.decode("latin-1")
        request = RoutingRequest(
            path=ex.route.path,
            body=incoming.json,
            media=media,
            key_name=ex.key_name,
            key_digest=None if ex.key is None else ex.key.digest,
            session=session,
            line=None if ex.model is None else self.pool.index.line(ex.model),
        )
        decision = await self.policy.choose(request, engines)
        ex.policy = self.policy.name
        ex.anchor_kind = decision.anchor_kind
        ex.spilled = decision.spilled
        if decision.spilled:
            self._counts.spilled += 1
        else:
            self._counts.first += 1
        return decision.engines
