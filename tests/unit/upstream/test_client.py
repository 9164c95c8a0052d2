"""The upstream client's connection state machine (gateway/upstream/client.py), in-process
against scripted engines on loopback: asyncio servers that answer each request as the
test's script says, byte for byte, and record what they received.

Covered: reuse of a kept-alive connection, answers that arrive in pieces, chunked
answers, an engine that closes without answering (on a fresh and on a reused
connection, and one that then refuses to reconnect), back-pressure at the high-water
mark, and TLS with the engine's name as the server name (SNI and certificate check)
while the socket goes to its address. The forwarder's failover after such a refusal
runs on the same engines, in-process, through the real client.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import pytest

from gateway.errors import UpstreamUnavailable
from gateway.exchange import Exchange
from gateway.observability.metrics import Metrics
from gateway.proxy.forward import Forwarder
from gateway.routing.pool import EnginePool
from gateway.routing.settings import RoutingSettings
from gateway.upstream.client import Upstream
from gateway.upstream.connection import _HIGH_WATER
from gateway.upstream.errors import (
    ClosedUnanswered,
    ConnectFailed,
    ConnectionBroken,
    ReadTimeout,
    ReconnectFailed,
)
from gateway.upstream.interfaces import Response
from gateway.upstream.origin import Origin
from tests.procs import ROOT

TLS = ROOT / "tests" / "data" / "tls"
OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


@dataclass
class Seen:
    conn: int
    index: int  # the request's place on its connection, from 0
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


# What an engine does with one request: the pieces of its answer (written one by one,
# with a short pause between; a last empty piece closes the connection after them), or
# None to close the connection without answering.
Script = Callable[["Engine", Seen], Awaitable[Sequence[bytes] | None]]


async def answer_ok(engine: Engine, seen: Seen) -> Sequence[bytes]:
    return [OK]


@dataclass
class Engine:
    script: Script = answer_ok
    tls: ssl.SSLContext | None = None
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    sni: list[str | None] = field(default_factory=list)
    port: int = 0
    server: asyncio.Server | None = None
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def __aenter__(self) -> Engine:
        if self.tls is not None:
            self.tls.sni_callback = lambda _sock, name, _ctx: self.sni.append(name)
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_listening()
        # Let the handlers see their connections close (the client closed them).
        if self.handlers:
            _, pending = await asyncio.wait(self.handlers, timeout=2)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def stop_listening(self) -> None:
        """Refuse new connections from now on (the engine is going away)."""
        if self.server is not None:
            self.server.close()

    def origin(self, server_name: str | None = None) -> Origin:
        scheme = "https" if self.tls else "http"
        return Origin(f"{scheme}://127.0.0.1:{self.port}", server_name)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        index = 0
        try:
            while line := await reader.readline():
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = h.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                seen = Seen(conn, index, method, target, headers, body)
                self.seen.append(seen)
                index += 1
                pieces = await self.script(self, seen)
                if pieces is None:
                    return  # closed without a byte of answer
                for piece in pieces:
                    if not piece:
                        return
                    writer.write(piece)
                    await writer.drain()
                    if len(pieces) > 1:
                        await asyncio.sleep(0.01)
        except (OSError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


def client(**options: object) -> Upstream:
    settings: dict[str, object] = {
        "connect_timeout": 1.0,
        "first_byte_timeout": 2.0,
        "keepalive": 4.0,
        **options,
    }
    return Upstream(**settings)  # type: ignore[arg-type]


async def get(upstream: Upstream, origin: Origin, method: str = "GET") -> tuple[int, bytes]:
    body = b'{"x":1}' if method == "POST" else None
    resp = await upstream.request(origin, method, "/v1/models", [(b"x-test", b"1")], body)
    try:
        return resp.status, await resp.read(2.0)
    finally:
        resp.close()


# --- reuse, pieces, chunked --------------------------------------------------------------


async def test_a_connection_read_to_its_end_is_reused() -> None:
    async with Engine() as engine:
        upstream = client()
        try:
            for _ in range(3):
                assert await get(upstream, engine.origin()) == (200, b'{"ok":true}')
        finally:
            await upstream.aclose()
    assert engine.connections == 1 and [s.index for s in engine.seen] == [0, 1, 2]
    seen = engine.seen[0]
    assert (seen.method, seen.target, seen.headers["host"]) == (
        "GET", "/v1/models", f"127.0.0.1:{engine.port}"
    )  # fmt: skip


async def test_a_reused_connection_carries_each_requests_own_base_path() -> None:
    """Two engines behind one address and name (the same connection key) share idle
    connections, so a connection opened for one carries the other's requests: each goes
    out under its own origin's base path, never the one the connection was opened for."""
    async with Engine() as engine:
        first = Origin(f"http://127.0.0.1:{engine.port}/a/")
        second = Origin(f"http://127.0.0.1:{engine.port}/b")
        assert first.key == second.key
        upstream = client()
        try:
            for origin in (first, second, first):
                assert await get(upstream, origin) == (200, b'{"ok":true}')
        finally:
            await upstream.aclose()
    assert engine.connections == 1
    assert [s.target for s in engine.seen] == ["/a/v1/models", "/b/v1/models", "/a/v1/models"]


async def test_an_answer_left_unread_closes_its_connection() -> None:
    async def half(engine: Engine, seen: Seen) -> Sequence[bytes]:
        if seen.conn == 0:
            return [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789"]
        return [OK]

    async with Engine(half) as engine:
        upstream = client()
        try:
            resp = await upstream.request(engine.origin(), "GET", "/v1/models", [], None)
            resp.close()  # the body not all there: never reused half read
            assert await get(upstream, engine.origin()) == (200, b'{"ok":true}')
        finally:
            await upstream.aclose()
    assert engine.connections == 2


async def test_an_answer_in_pieces() -> None:
    body = b'{"text":"' + b"y" * 5000 + b'"}'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    whole = head % len(body) + body
    # The status line, a header name and the body each cut across writes.
    cuts = [5, 20, 40, len(head % len(body)) + 3, len(whole) - 1]
    pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]

    async def trickle(engine: Engine, seen: Seen) -> Sequence[bytes]:
        return pieces

    async with Engine(trickle) as engine:
        upstream = client()
        try:
            resp = await upstream.request(engine.origin(), "GET", "/x", [], None)
            assert (resp.status, resp.content_type, resp.content_length) == (
                200, "application/json", len(body)
            )  # fmt: skip
            got = b""
            while chunk := await resp.readany():
                got += chunk
            resp.close()
            assert got == body
            assert await get(upstream, engine.origin()) == (200, body)
        finally:
            await upstream.aclose()
    assert engine.connections == 1


async def test_readsome_bounds_the_engines_silence_not_the_callers_time() -> None:
    async def stall(engine: Engine, seen: Seen) -> Sequence[bytes]:
        # One chunk, then nothing: the connection stays open, the body unfinished.
        return [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n"]

    async with Engine(stall) as engine:
        upstream = client()
        try:
            resp = await upstream.request(engine.origin(), "GET", "/x", [], None)
            await asyncio.sleep(0.5)  # the caller's own time, longer than the limit
            assert await resp.readsome(0.3) == b"abc"
            started = time.monotonic()
            with pytest.raises(ReadTimeout):
                await resp.readsome(0.3)
            assert 0.25 <= time.monotonic() - started < 5
            resp.close()
        finally:
            await upstream.aclose()


async def test_a_chunked_answer_is_joined_and_its_connection_reused() -> None:
    async def chunked(engine: Engine, seen: Seen) -> Sequence[bytes]:
        return [
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            b"3\r\nabc\r\n",
            b"4\r\nde",
            b"fg\r\n0\r\n\r\n",
        ]

    async with Engine(chunked) as engine:
        upstream = client()
        try:
            for _ in range(2):
                assert await get(upstream, engine.origin()) == (200, b"abcdefg")
        finally:
            await upstream.aclose()
    assert engine.connections == 1


async def test_a_short_body_is_broken_not_truncated() -> None:
    async def short(engine: Engine, seen: Seen) -> Sequence[bytes]:
        return [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789", b""]

    async with Engine(short) as engine:
        upstream = client()
        try:
            resp = await upstream.request(engine.origin(), "GET", "/x", [], None)
            with pytest.raises(ConnectionBroken) as info:
                await resp.read(1.0)
            assert not isinstance(info.value, ClosedUnanswered)
            resp.close()
        finally:
            await upstream.aclose()


# --- closed without an answer --------------------------------------------------------


def drop_on(indexes: set[int], *, then_stop: bool = False) -> Script:
    """Answer every request but those at `indexes` on their connection: close those
    without answering (and stop listening first, with `then_stop`)."""

    async def script(engine: Engine, seen: Seen) -> Sequence[bytes] | None:
        if seen.index in indexes:
            if then_stop:
                engine.stop_listening()
            return None
        return [OK]

    return script


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried() -> None:
    async with Engine(drop_on({0})) as engine:
        upstream = client()
        try:
            with pytest.raises(ClosedUnanswered):
                await get(upstream, engine.origin(), "POST")
        finally:
            await upstream.aclose()
    assert len(engine.seen) == 1


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_reused_connection_closed_without_an_answer_is_retried_fresh(
    method: str,
) -> None:
    """What uvicorn does at its keep-alive timeout: the request written onto the idle
    connection is never read. It goes once more, on a new connection."""
    async with Engine(drop_on({1})) as engine:
        upstream = client()
        try:
            assert await get(upstream, engine.origin(), method) == (200, b'{"ok":true}')
            assert await get(upstream, engine.origin(), method) == (200, b'{"ok":true}')
        finally:
            await upstream.aclose()
    assert [(s.conn, s.index, s.method) for s in engine.seen] == [
        (0, 0, method), (0, 1, method), (1, 0, method)
    ]  # fmt: skip
    assert engine.seen[1].body == engine.seen[2].body


async def test_a_retried_request_closed_again_is_broken() -> None:
    async def script(engine: Engine, seen: Seen) -> Sequence[bytes] | None:
        # The retry, first on its fresh connection, is dropped too: no second retry.
        return None if (seen.conn, seen.index) in ((0, 1), (1, 0)) else [OK]

    async with Engine(script) as engine:
        upstream = client()
        try:
            await get(upstream, engine.origin())
            with pytest.raises(ClosedUnanswered):
                await get(upstream, engine.origin())
        finally:
            await upstream.aclose()
    assert [(s.conn, s.index) for s in engine.seen] == [(0, 0), (0, 1), (1, 0)]


async def test_a_partial_answer_on_a_reused_connection_is_not_retried() -> None:
    async def partial(engine: Engine, seen: Seen) -> Sequence[bytes] | None:
        if seen.index == 0:
            return [OK]
        engine.stop_listening()
        return [b"HTTP/1.1 200 OK\r\ncontent-le", b""]

    async with Engine(partial) as engine:
        upstream = client()
        try:
            await get(upstream, engine.origin())
            with pytest.raises(ConnectionBroken) as info:
                await get(upstream, engine.origin())
            assert not isinstance(info.value, ClosedUnanswered)
        finally:
            await upstream.aclose()
    assert len(engine.seen) == 2


async def test_a_reused_connection_closed_then_refused_is_reconnect_failed() -> None:
    async with Engine(drop_on({1}, then_stop=True)) as engine:
        upstream = client()
        try:
            await get(upstream, engine.origin())
            with pytest.raises(ReconnectFailed):
                await get(upstream, engine.origin(), "POST")
        finally:
            await upstream.aclose()
    assert len(engine.seen) == 2


# --- back-pressure -------------------------------------------------------------------


async def test_reading_pauses_at_the_high_water_mark_and_resumes() -> None:
    size = 4 * 1024 * 1024
    piece = b"z" * 65536

    async def big(engine: Engine, seen: Seen) -> Sequence[bytes]:
        head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size
        return [head + piece, *[piece] * (size // len(piece) - 1)]

    async with Engine(big) as engine:
        upstream = client()
        try:
            resp = await upstream.request(engine.origin(), "GET", "/big", [], None)
            transport = resp._conn.transport  # type: ignore[attr-defined]
            assert transport is not None
            deadline = time.monotonic() + 5
            while transport.is_reading():
                assert time.monotonic() < deadline, "reading never paused"
                await asyncio.sleep(0.01)
            # Paused with the buffer just past the mark (one read beyond at most).
            buffered = resp._size  # type: ignore[attr-defined]
            assert _HIGH_WATER < buffered <= _HIGH_WATER + 256 * 1024
            await asyncio.sleep(0.1)
            assert resp._size == buffered  # type: ignore[attr-defined]
            got = len(await resp.readany())
            assert transport.is_reading()
            while chunk := await resp.readany():
                got += len(chunk)
            assert got == size
            resp.close()
        finally:
            await upstream.aclose()


async def test_read_of_a_whole_body_goes_past_the_high_water_mark() -> None:
    """`read` (health checks, model lists, scrapes) wants everything: it must not stall
    on the pause meant for a slow client."""
    size = 1024 * 1024

    async def big(engine: Engine, seen: Seen) -> Sequence[bytes]:
        return [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size, b"m" * size]

    async with Engine(big) as engine:
        upstream = client()
        try:
            status, body = await get(upstream, engine.origin())
        finally:
            await upstream.aclose()
    assert status == 200 and body == b"m" * size


# --- TLS -------------------------------------------------------------------------------


def engine_tls(cert: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(TLS / f"{cert}.pem", TLS / f"{cert}.key")
    return context


def trusting() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=TLS / "engine-ca.pem")


async def test_tls_names_the_engine_while_connecting_to_its_address() -> None:
    async with Engine(tls=engine_tls("engine-test")) as engine:
        upstream = client(ssl_context=trusting())
        try:
            origin = engine.origin("engine.test")
            assert await get(upstream, origin) == (200, b'{"ok":true}')
            assert await get(upstream, origin) == (200, b'{"ok":true}')
        finally:
            await upstream.aclose()
    assert engine.sni == ["engine.test"] and engine.connections == 1
    assert engine.seen[0].headers["host"] == f"engine.test:{engine.port}"


@pytest.mark.parametrize(
    ("server_name", "trust"),
    [
        ("other.test", "engine-ca"),  # trusted issuer, another name
        (None, "engine-ca"),  # the address itself is not in the certificate
        ("engine.test", None),  # the system's trust store does not know the test CA
    ],
)
async def test_tls_refuses_a_certificate_for_another_name_or_issuer(
    server_name: str | None, trust: str | None
) -> None:
    async with Engine(tls=engine_tls("engine-test")) as engine:
        upstream = client(ssl_context=trusting() if trust else None)
        try:
            with pytest.raises(ConnectFailed):
                await get(upstream, engine.origin(server_name))
        finally:
            await upstream.aclose()
    assert engine.seen == []


async def test_connections_under_another_server_name_are_not_shared() -> None:
    async with Engine(tls=engine_tls("engine-test")) as engine:
        upstream = client(ssl_context=trusting())
        try:
            await get(upstream, engine.origin("engine.test"))
            # Same address and port, another name: a new handshake, which fails.
            with pytest.raises(ConnectFailed):
                await get(upstream, engine.origin("other.test"))
        finally:
            await upstream.aclose()
    assert engine.sni == ["engine.test", "other.test"]


@pytest.mark.parametrize(
    ("url", "server_name", "host_header"),
    [
        ("https://10.0.0.7:8443", "engine.svc", b"engine.svc:8443"),
        ("https://10.0.0.7:443", "engine.svc", b"engine.svc"),
        ("http://[fd00::7]:80", "engine.svc", b"engine.svc"),
        ("https://10.0.0.7:8443", None, b"10.0.0.7:8443"),
    ],
)
def test_host_header_of_a_named_origin(
    url: str, server_name: str | None, host_header: bytes
) -> None:
    assert Origin(url, server_name).host_header == host_header


# --- failover after a refused reconnect ----------------------------------------------


@pytest.mark.parametrize(("method", "fails_over"), [("GET", True), ("HEAD", True), ("POST", False)])
async def test_refused_reconnect_fails_over_only_idempotent_methods(
    method: str, fails_over: bool
) -> None:
    """Engine A closes a reused connection without answering and refuses to reconnect:
    it may have read the request. A GET or HEAD moves on to B; a POST is not sent
    anywhere else (502), and A is ejected either way."""
    async with Engine(drop_on({1}, then_stop=True)) as a, Engine() as b:
        upstream = client()
        pool = EnginePool(
            [f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"],
            RoutingSettings(),
            upstream=upstream,
        )
        engine_a, engine_b = pool.engines
        for e in pool.engines:
            e.healthy = True
        forwarder = Forwarder(upstream, pool, Metrics())
        relayed: list[int] = []

        async def relay(resp: Response) -> None:
            await resp.read(1.0)
            relayed.append(resp.status)

        try:
            # A's first request leaves a kept-alive connection for the second.
            await forwarder.forward(Exchange("r1", "/", 0.0), [engine_a], "GET", "/", [], None,
                                    relay)  # fmt: skip
            ex = Exchange("r2", "/", 0.0)
            body = b"{}" if method == "POST" else None
            forward = forwarder.forward(ex, [engine_a, engine_b], method, "/v1/x", [], body, relay)
            if fails_over:
                await forward
                assert relayed == [200, 200] and ex.failovers == 1
                assert [s.method for s in b.seen] == [method]
            else:
                with pytest.raises(UpstreamUnavailable) as info:
                    await forward
                assert info.value.code == "upstream_unavailable" and b.seen == []
            assert not engine_a.healthy and engine_b.healthy
            assert len(a.seen) == 2
        finally:
            await upstream.aclose()
