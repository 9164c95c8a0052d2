"""The connection protocol (gateway/server/protocol.py) on a mock transport and a mock
loop, the way uvicorn tests its own protocols (encode/uvicorn tests/protocols/test_http.py):
bytes in through `data_received`, the answer read from the transport's buffer, the
app's tasks run one at a time and the clock moved by hand. No socket, no timing: every
limit is checked at the byte or the second it is set to.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.config.settings import LimitsSettings, TimeoutSettings
from gateway.server.limits import (
    CONNECTION_GUARD,
    ConnectionGuard,
)
from gateway.server.protocol import (
    MAX_PIPELINED,
    MIN_CHUNK_BYTES,
    MIN_CHUNKS,
    GatewayProtocol,
    head_size,
)
from gateway.types import Message, Receive, Scope, Send

MAX_HEADER_BYTES = 4096
REQUEST_HEAD = 10.0
GET = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"


class MockTransport:
    """An asyncio transport that keeps what is written and says how it was closed."""

    def __init__(self) -> None:
        self.buffer = b""
        self.closed = False
        self.aborted = False
        self.eof = False
        self.read_paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.buffer += data

    def write_eof(self) -> None:
        self.eof = True

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.read_paused = True

    def resume_reading(self) -> None:
        self.read_paused = False

    def set_protocol(self, protocol: object) -> None:
        pass


class MockTask:
    def add_done_callback(self, callback: Callable[..., object]) -> None:
        pass


class MockTimer:
    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]):
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class MockLoop:
    """The loop the protocol and the guard see: tasks kept until `run_one`, timers fired
    by `advance`, a clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.tasks: list[Coroutine[Any, Any, None]] = []
        self.timers: list[MockTimer] = []

    def time(self) -> float:
        return self.now

    def create_task(self, coro: Coroutine[Any, Any, None], **kwargs: Any) -> MockTask:
        self.tasks.append(coro)
        return MockTask()

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> MockTimer:
        timer = MockTimer(self.now + delay, callback, args)
        self.timers.append(timer)
        return timer

    async def run_one(self) -> None:
        await self.tasks.pop(0)

    async def run_all(self) -> None:
        while self.tasks:
            await self.run_one()

    def advance(self, seconds: float) -> None:
        """Move the clock and fire the timers now due (the guard's sweep)."""
        self.now += seconds
        while due := [t for t in self.timers if t.when <= self.now and not t.cancelled]:
            for timer in due:
                self.timers.remove(timer)
                timer.callback(*timer.args)

    def close(self) -> None:
        for coro in self.tasks:
            coro.close()


class App:
    """Answers 200 `ok` after reading the whole body; records what it was given."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.bodies: list[bytes] = []
        self.disconnects = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.paths.append(scope["path"])
        body = b""
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Connection:
    def __init__(self, protocol: GatewayProtocol, transport: MockTransport, loop: MockLoop):
        self.protocol = protocol
        self.transport = transport
        self.loop = loop


@pytest.fixture
def app() -> App:
    return App()


@pytest.fixture
def guard() -> ConnectionGuard:
    return ConnectionGuard(
        TimeoutSettings(request_head=REQUEST_HEAD),
        LimitsSettings(max_header_bytes=MAX_HEADER_BYTES),
        fd_limit=1 << 16,
    )


@pytest.fixture
def connect(app: App, guard: ConnectionGuard) -> Any:
    loops: list[MockLoop] = []
    state = ServerState()

    def make() -> Connection:
        loop = MockLoop()
        loops.append(loop)
        config = Config(app=app, lifespan="off", log_config=None)
        protocol = GatewayProtocol(config, state, {CONNECTION_GUARD: guard}, _loop=loop)  # type: ignore[arg-type]
        transport = MockTransport()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return Connection(protocol, transport, loop)

    yield make
    for loop in loops:
        loop.close()


def responses(buffer: bytes) -> list[bytes]:
    """The status lines in `buffer`."""
    return [line for line in buffer.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


def error_code(buffer: bytes) -> str:
    return str(orjson.loads(buffer.split(b"\r\n\r\n", 1)[1])["error"]["code"])


def head_with(size: int) -> bytes:
    """A GET whose head is `size` bytes long as sent."""
    start = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Pad: "
    end = b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


# --- head size -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "piece", "answered"),
    [
        (MAX_HEADER_BYTES - 64, None, True),
        (MAX_HEADER_BYTES - 64, 100, True),
        (MAX_HEADER_BYTES + 64, None, False),
        # A head over the cap in small reads is refused once the count passes the cap.
        (MAX_HEADER_BYTES + 64, 100, False),
        (8 * MAX_HEADER_BYTES, 1000, False),
    ],
)
async def test_head_size_cap(
    connect: Callable[[], Connection], app: App, size: int, piece: int | None, answered: bool
) -> None:
    conn = connect()
    data = head_with(size)
    for start in range(0, len(data), piece or len(data)):
        if conn.transport.closed or conn.transport.eof:
            break
        conn.protocol.data_received(data[start : start + (piece or len(data))])
    await conn.loop.run_all()
    if answered:
        assert responses(conn.transport.buffer) == [b"HTTP/1.1 200 OK"]
        assert app.paths == ["/healthz"] and not conn.transport.closed
        assert conn.protocol.guard.counts.headers_too_large == 0
    else:
        assert responses(conn.transport.buffer) == [b"HTTP/1.1 431 Request Header Fields Too Large"]
        assert error_code(conn.transport.buffer) == "headers_too_large"
        assert b"connection: close" in conn.transport.buffer and conn.transport.eof
        assert app.paths == []
        assert conn.protocol.guard.counts.headers_too_large == 1


async def test_a_head_that_never_ends_is_refused_once_over_the_cap(
    connect: Callable[[], Connection], app: App
) -> None:
    """httptools holds a header value whole until it ends: the bytes are counted as
    they arrive, not when the head completes."""
    conn = connect()
    conn.protocol.data_received(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Pad: ")
    for _ in range(MAX_HEADER_BYTES // 512 + 1):
        conn.protocol.data_received(b"a" * 512)
    assert error_code(conn.transport.buffer) == "headers_too_large"
    assert conn.protocol.guard.counts.headers_too_large == 1 and app.paths == []


async def test_input_after_a_431_is_dropped(connect: Callable[[], Connection], app: App) -> None:
    conn = connect()
    conn.protocol.data_received(head_with(MAX_HEADER_BYTES + 64))
    answer = conn.transport.buffer
    conn.protocol.data_received(GET)
    await conn.loop.run_all()
    assert conn.transport.buffer == answer and app.paths == []


# --- pipelining ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "answered", "closed"),
    [
        (3, 3, False),
        (MAX_PIPELINED + 1, MAX_PIPELINED + 1, False),
        # One beyond the queue: the queued ones are answered, the last closes.
        (MAX_PIPELINED + 2, MAX_PIPELINED + 1, True),
        (MAX_PIPELINED * 4, MAX_PIPELINED + 1, True),
    ],
)
async def test_pipelined_requests_queue_at_most_max_pipelined(
    connect: Callable[[], Connection], app: App, sent: int, answered: int, closed: bool
) -> None:
    conn = connect()
    conn.protocol.data_received(GET * sent)
    await conn.loop.run_all()
    assert responses(conn.transport.buffer) == [b"HTTP/1.1 200 OK"] * answered
    assert len(app.paths) == answered
    assert conn.transport.closed is closed
    assert conn.protocol.guard.counts.pipeline_full == int(closed)
    if closed:
        last = conn.transport.buffer.rsplit(b"HTTP/1.1 200 OK", 1)[1]
        assert b"connection: close" in last.lower()


async def test_input_after_a_full_pipeline_is_dropped(
    connect: Callable[[], Connection], app: App
) -> None:
    conn = connect()
    conn.protocol.data_received(GET * (MAX_PIPELINED + 2))
    conn.protocol.data_received(GET)
    await conn.loop.run_all()
    assert len(app.paths) == MAX_PIPELINED + 1


# --- body chunks -----------------------------------------------------------------------


def chunked(sizes: list[int]) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (n, b"x" * n) for n in sizes)
    return head + body + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("sizes", "refused"),
    [
        ([1] * (MIN_CHUNKS - 1), False),
        ([MIN_CHUNK_BYTES] * MIN_CHUNKS, False),
        # Small pieces are fine while the average stays at MIN_CHUNK_BYTES.
        ([2 * MIN_CHUNK_BYTES, 1] * (MIN_CHUNKS // 2), False),
        ([1] * MIN_CHUNKS, True),
        ([MIN_CHUNK_BYTES - 1] * MIN_CHUNKS, True),
        ([1] * (MIN_CHUNKS * 8), True),
    ],
)
async def test_chunked_body_in_pieces_too_small(
    connect: Callable[[], Connection], app: App, sizes: list[int], refused: bool
) -> None:
    conn = connect()
    conn.protocol.data_received(chunked(sizes))
    await conn.loop.run_all()
    if refused:
        assert responses(conn.transport.buffer) == [b"HTTP/1.1 400 Bad Request"]
        assert error_code(conn.transport.buffer) == "body_chunks_too_small"
        # The app, reading the body, saw the client gone: nothing would be forwarded.
        assert app.bodies == [] and app.disconnects == 1
        assert conn.protocol.guard.counts.body_chunks_too_small == 1
    else:
        assert responses(conn.transport.buffer) == [b"HTTP/1.1 200 OK"]
        assert app.bodies == [b"x" * sum(sizes)]
        assert conn.protocol.guard.counts.body_chunks_too_small == 0


async def test_small_reads_of_a_content_length_body_are_not_chunks(
    connect: Callable[[], Connection], app: App
) -> None:
    """The pace of a plain body is the body reader's to judge, not the chunk rule's."""
    conn = connect()
    body = b"x" * (MIN_CHUNKS * 2)
    conn.protocol.data_received(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    for i in range(len(body)):
        conn.protocol.data_received(body[i : i + 1])
    await conn.loop.run_all()
    assert responses(conn.transport.buffer) == [b"HTTP/1.1 200 OK"]
    assert app.bodies == [body]


# --- head deadline ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "counter"),
    [(b"", "idle_timeout"), (b"GET /healthz HTTP/1.1\r\nHost:", "head_timeout")],
)
async def test_a_head_not_complete_by_its_deadline_is_closed_unanswered(
    connect: Callable[[], Connection], app: App, sent: bytes, counter: str
) -> None:
    conn = connect()
    if sent:
        conn.protocol.data_received(sent)
    conn.loop.advance(REQUEST_HEAD - 1)
    assert not conn.transport.closed
    conn.loop.advance(2)
    assert conn.transport.closed and conn.transport.buffer == b""
    assert getattr(conn.protocol.guard.counts, counter) == 1
    assert app.paths == []


async def test_the_head_deadline_does_not_restart_with_each_byte(
    connect: Callable[[], Connection],
) -> None:
    conn = connect()
    for byte in GET[:-4]:
        conn.loop.advance(REQUEST_HEAD / len(GET))
        conn.protocol.data_received(bytes([byte]))
    conn.loop.advance(REQUEST_HEAD / 2)
    assert conn.transport.closed and conn.transport.buffer == b""
    assert conn.protocol.guard.counts.head_timeout == 1


async def test_a_request_in_progress_is_not_closed_at_the_head_deadline(
    connect: Callable[[], Connection], app: App
) -> None:
    conn = connect()
    conn.protocol.data_received(GET)
    conn.loop.advance(REQUEST_HEAD * 3)
    assert not conn.transport.closed
    await conn.loop.run_all()
    assert responses(conn.transport.buffer) == [b"HTTP/1.1 200 OK"]


# --- connection cap --------------------------------------------------------------------


async def test_at_the_cap_a_new_connection_evicts_the_longest_waiting(
    app: App, connect: Callable[[], Connection], guard: ConnectionGuard
) -> None:
    guard.max_connections = 2
    busy, idle = connect(), connect()
    busy.protocol.data_received(GET)
    newcomer = connect()
    assert idle.transport.closed and idle.transport.buffer == b""
    idle.protocol.connection_lost(None)
    assert not busy.transport.closed and not newcomer.transport.closed
    # Every connection left has a request in progress: the next one is refused at once.
    newcomer.protocol.data_received(GET)
    refused = connect()
    assert refused.transport.aborted
    assert guard.counts.max_connections == 1
    await busy.loop.run_all()
    await newcomer.loop.run_all()
    assert app.paths == ["/healthz", "/healthz"]


def test_head_size_counts_the_head_as_sent() -> None:
    url = b"/v1/chat/completions"
    headers = [(b"host", b"gw"), (b"content-length", b"12")]
    sent = b"POST " + url + b" HTTP/1.1\r\nhost: gw\r\ncontent-length: 12\r\n\r\n"
    assert abs(head_size(url, headers) - len(sent)) <= 2
