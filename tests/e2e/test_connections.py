"""Limits on client connections, through the gateway under uvicorn on loopback: the head
deadline (slowloris), idle and keep-alive connections, the body's pace (408), the header
bytes cap (431) and the connection cap. The rules behind them, in process:
tests/unit/server/ and tests/unit/proxy/test_body.py.

Gateway G has short limits (head 2 s, body 3 s with 1 s of grace at 1,000 bytes a
second, 8 KiB of head); gateway C has a cap of 8 connections and a 1 s keep-alive.
Times are asserted with wide margins: the machine running the tests is loaded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.harness.metrics import HTTP
from bench.sim.config import DEFAULT_MODEL as MODEL
from gateway.server.protocol import MAX_PIPELINED
from tests.procs import Proc, gateway_proc, metric, running, sim_proc, sim_received, wait_for

KEY = "sk-conn-0123456789abcdef-SECRET"
REQUEST_HEAD = 2.0
BODY_DEADLINE = 3.0
BODY_GRACE = 1.0
MIN_RATE = 1000
MAX_HEADER_BYTES = 8192
MAX_CONNECTIONS = 8
RESPONSE_STALL = 1.0
CLOSED = "gateway_client_connections_closed_total"
AUTH_JSON = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@dataclass
class Stack:
    sim: Proc
    g: Proc
    c: Proc


def _env(sim: Proc, **extra: str) -> dict[str, str]:
    return {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_PUBLIC_METRICS": "true",
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        **extra,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("connections")
    sim = sim_proc(tmp, "--latency", "zero")
    g = gateway_proc(
        tmp,
        _env(
            sim,
            GATEWAY_TIMEOUTS__REQUEST_HEAD=str(REQUEST_HEAD),
            GATEWAY_TIMEOUTS__REQUEST_BODY=str(BODY_DEADLINE),
            GATEWAY_TIMEOUTS__REQUEST_BODY_GRACE=str(BODY_GRACE),
            GATEWAY_LIMITS__MIN_BODY_RATE=str(MIN_RATE),
            GATEWAY_LIMITS__MAX_HEADER_BYTES=str(MAX_HEADER_BYTES),
            GATEWAY_TIMEOUTS__RESPONSE_STALL=str(RESPONSE_STALL),
        ),
    )
    c = gateway_proc(
        tmp,
        _env(
            sim,
            GATEWAY_LIMITS__MAX_CONNECTIONS=str(MAX_CONNECTIONS),
            GATEWAY_TIMEOUTS__CLIENT_KEEPALIVE="1",
        ),
    )
    with running(sim, ready_path="/health"), running(g, c, ready_path="/healthz"):
        for gw in (g, c):
            assert wait_for(lambda gw=gw: HTTP.get(gw.url + "/readyz").status_code == 200)
        yield Stack(sim, g, c)


# --- raw connections ------------------------------------------------------------------


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def wait_closed(sock: socket.socket, timeout: float = 15.0) -> tuple[float, bytes]:
    """Seconds until the peer closed `sock` (EOF or reset), and what it sent before."""
    started = time.monotonic()
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - started, got


class Reader:
    """Responses with a Content-Length body, one after another, from `sock`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"closed before a whole response: {self.data!r}"
        self.data += chunk

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.data:
            self._more()
        head, _, self.data = self.data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = int(headers["content-length"])
        while len(self.data) < length:
            self._more()
        body, self.data = self.data[:length], self.data[length:]
        return int(lines[0].split()[1]), headers, body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The one response expected on `sock`."""
    return Reader(sock).response()


def chat_body(pad: int = 0) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi" + " " * pad}],
        "max_tokens": 1,
    }
    return json.dumps(body).encode()


def chat_head(length: int, path: str = "/v1/chat/completions", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode()


def get(path: str = "/healthz", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: gw\r\n{extra}\r\n".encode()


def error_code(body: bytes) -> str:
    return str(json.loads(body)["error"]["code"])


class Dribbler(threading.Thread):
    """Sends `parts` on `sock`, one every `every` seconds, until the peer closes."""

    def __init__(self, sock: socket.socket, parts: list[bytes], every: float) -> None:
        super().__init__(daemon=True)
        self.sock, self.parts, self.every = sock, parts, every

    def run(self) -> None:
        for part in self.parts:
            try:
                self.sock.sendall(part)
            except OSError:
                return
            time.sleep(self.every)


def closed_metric(gw: Proc, reason: str) -> float:
    return metric(gw.url, CLOSED, reason=reason)


# --- the request head -------------------------------------------------------------------


@pytest.mark.slow
def test_head_dribble_is_closed_at_the_deadline_while_others_are_served(stack: Stack) -> None:
    before = closed_metric(stack.g, "head_timeout")
    with connect(stack.g.port) as sock:
        lines = [b"GET /healthz HTTP/1.1\r\n"] + [b"X-Slow-%d: 1\r\n" % i for i in range(40)]
        dribbler = Dribbler(sock, lines, 0.5)
        dribbler.start()
        # Meanwhile, a normal request on another connection.
        time.sleep(0.5)
        r = HTTP.post(
            stack.g.url + "/v1/chat/completions", headers=AUTH_JSON, content=chat_body(), timeout=5
        )
        assert r.status_code == 200
        elapsed, got = wait_closed(sock)
        elapsed += 0.5  # the sleep above
    # Counted from the connection's opening, not from the last byte: never later.
    assert REQUEST_HEAD * 0.5 <= elapsed <= REQUEST_HEAD + 3, elapsed
    assert got == b""  # a silent close: no answer to a request that never came
    dribbler.join(5)
    assert closed_metric(stack.g, "head_timeout") == before + 1


@pytest.mark.slow
def test_silent_connection_is_closed(stack: Stack) -> None:
    before = closed_metric(stack.g, "idle_timeout")
    with connect(stack.g.port) as sock:
        elapsed, got = wait_closed(sock)
    assert REQUEST_HEAD * 0.5 <= elapsed <= REQUEST_HEAD + 3, elapsed
    assert got == b""
    assert closed_metric(stack.g, "idle_timeout") == before + 1


@pytest.mark.slow
def test_keepalive_head_deadline_counts_from_the_end_of_the_response(stack: Stack) -> None:
    """On a keep-alive connection the next head is due `request_head` after the previous
    response: starting it late does not buy time."""
    with connect(stack.g.port) as sock:
        sock.sendall(get())
        assert read_response(sock)[0] == 200
        answered = time.monotonic()
        time.sleep(REQUEST_HEAD * 0.9)
        Dribbler(sock, [b"GET /healthz HTTP/1.1\r\n", b"X-A: 1\r\n", b"X-B: 1\r\n"], 0.5).start()
        _, got = wait_closed(sock)
        elapsed = time.monotonic() - answered
        # From the first byte it would be 0.9 + 1 request_head.
        assert REQUEST_HEAD * 0.5 <= elapsed < REQUEST_HEAD * 1.9 - 0.3, elapsed
        assert got == b""


@pytest.mark.slow
def test_keepalive_idle_connection_is_closed(stack: Stack) -> None:
    """Gateway C: 1 s keep-alive, the head deadline (10 s) far away."""
    with connect(stack.c.port) as sock:
        sock.sendall(get())
        assert read_response(sock)[0] == 200
        elapsed, got = wait_closed(sock)
        assert 0.5 <= elapsed <= 5, elapsed
        assert got == b""


@pytest.mark.slow
def test_keepalive_and_pipelined_requests_still_work(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    body = chat_body()
    with connect(stack.g.port) as sock:
        reader = Reader(sock)
        # One after another on one connection.
        for _ in range(3):
            sock.sendall(chat_head(len(body)) + body)
            status, _, answer = reader.response()
            assert status == 200, answer
        # Pipelined: three requests in one write, answered in order.
        sock.sendall((chat_head(len(body)) + body) * 2 + get("/readyz"))
        answers = [reader.response() for _ in range(3)]
        assert [a[0] for a in answers] == [200, 200, 200]
        assert b"ready" in answers[2][2]
        # Within the head deadline of the last response, the connection still serves.
        time.sleep(REQUEST_HEAD * 0.4)
        sock.sendall(get())
        assert reader.response()[0] == 200
    assert sim_received(stack.sim.url) == before + 5


@pytest.mark.slow
def test_a_deep_pipeline_is_answered_in_part_then_closed(stack: Stack) -> None:
    # uvicorn queued every request of a read: 60 connections writing 256 KiB of pipelined
    # GETs (no key) took the gateway to 1.2 GB and blocked it for 8 s.
    before = sim_received(stack.sim.url)
    closed_before = closed_metric(stack.g, "pipeline_full")
    body = chat_body()
    sent = 200
    with connect(stack.g.port) as sock:
        sock.sendall((chat_head(len(body)) + body) * sent)
        reader = Reader(sock)
        answers = []
        while True:
            status, headers, _ = reader.response()
            answers.append(status)
            if headers.get("connection") == "close":
                break
        elapsed, rest = wait_closed(sock)
    # The one being answered and the queue (a second read may add to it), not all.
    assert MAX_PIPELINED + 1 <= len(answers) <= 2 * MAX_PIPELINED + 1, len(answers)
    assert set(answers) == {200}
    assert rest == b"" and elapsed < 5
    # The requests beyond the queue never reached the engine.
    assert sim_received(stack.sim.url) == before + len(answers)
    assert closed_metric(stack.g, "pipeline_full") == closed_before + 1


# --- the request body -------------------------------------------------------------------


def _slow_body(
    stack: Stack, head: bytes, parts: list[bytes], every: float
) -> tuple[float, int, dict[str, str], bytes, bytes]:
    """Send `head`, then `parts` one every `every` s; the time to the answer, the
    answer, and what followed it until the connection closed."""
    before = sim_received(stack.sim.url)
    with connect(stack.g.port) as sock:
        sock.sendall(head)
        started = time.monotonic()
        Dribbler(sock, parts, every).start()
        status, headers, body = read_response(sock)
        elapsed = time.monotonic() - started
        _, after = wait_closed(sock, timeout=5)
    assert sim_received(stack.sim.url) == before  # nothing reached the engine
    return elapsed, status, headers, body, after


@pytest.mark.slow
def test_a_stalled_body_is_cut_with_408(stack: Stack) -> None:
    """Headers and one byte of body, then nothing."""
    elapsed, status, headers, body, after = _slow_body(stack, chat_head(100) + b"{", [], 1)
    assert (status, error_code(body)) == (408, "request_timeout")
    assert headers["connection"] == "close"
    assert after == b""  # and the connection closed
    assert BODY_GRACE * 0.5 <= elapsed <= BODY_DEADLINE + 3, elapsed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pad", "piece", "every", "says", "earliest", "latest"),
    [
        # 80 bytes a second against a minimum of 1,000: cut at the rate's point, well
        # before the deadline.
        pytest.param(
            5000, 20, 0.25, b"bytes a second", BODY_GRACE * 0.5, BODY_DEADLINE + 2, id="rate"
        ),
        # 1,500 bytes a second, above the minimum rate, but 6 KB take longer than 3 s.
        pytest.param(
            6000, 300, 0.2, b"within 3 s", BODY_DEADLINE * 0.8, BODY_DEADLINE + 3, id="deadline"
        ),
    ],
)
def test_a_dripped_body_is_cut_with_408(
    stack: Stack, pad: int, piece: int, every: float, says: bytes, earliest: float, latest: float
) -> None:
    """`piece` bytes every `every` seconds."""
    body = chat_body(pad=pad)
    parts = [body[i : i + piece] for i in range(0, len(body), piece)]
    elapsed, status, _, answer, _ = _slow_body(stack, chat_head(len(body)), parts, every)
    assert (status, error_code(answer)) == (408, "request_timeout")
    assert says in answer
    assert earliest <= elapsed <= latest, elapsed


@pytest.mark.slow
def test_a_slow_upload_is_cut_with_408(stack: Stack) -> None:
    """Multipart uploads are read by the same rule."""
    boundary = "b0undary"
    head = (
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}"
        f"\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: 50000\r\n\r\n--{boundary}\r\n"
    ).encode()
    elapsed, status, _, answer, _ = _slow_body(stack, head, [], 1)
    assert (status, error_code(answer)) == (408, "request_timeout")
    assert elapsed <= BODY_DEADLINE + 3


@pytest.mark.slow
def test_a_body_at_a_legitimate_pace_is_forwarded(stack: Stack) -> None:
    """About 2,500 bytes a second, after a pause within the grace: 4.5 KB in ~2 s."""
    before = sim_received(stack.sim.url)
    body = chat_body(pad=4500)
    parts = [body[i : i + 250] for i in range(0, len(body), 250)]
    with connect(stack.g.port) as sock:
        sock.sendall(chat_head(len(body)))
        time.sleep(BODY_GRACE * 0.5)
        Dribbler(sock, parts, 0.1).start()
        status, _, answer = read_response(sock)
    assert status == 200, answer
    assert sim_received(stack.sim.url) == before + 1


@pytest.mark.slow
def test_a_large_body_at_full_speed_is_unaffected(stack: Stack) -> None:
    # An unknown field: the padding costs no tokens at the engine.
    body = json.dumps({**json.loads(chat_body()), "pad": "x" * 24 * 1024 * 1024}).encode()
    r = HTTP.post(
        stack.g.url + "/v1/chat/completions",
        headers=AUTH_JSON,
        content=body,
        timeout=30,
    )
    assert r.status_code == 200, r.text


def _chunked(data: bytes, sizes: list[int], rest: int) -> bytes:
    """`data` in chunked framing: chunks of `sizes` first, then of `rest` bytes."""
    out, at = [], 0
    for size in sizes:
        out.append(b"%x\r\n%s\r\n" % (size, data[at : at + size]))
        at += size
    while at < len(data):
        piece = data[at : at + rest]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        at += rest
    return b"".join(out) + b"0\r\n\r\n"


def chunked_head(extra: str = "") -> bytes:
    return chat_head(0).replace(
        b"Content-Length: 0", b"Transfer-Encoding: chunked" + extra.encode()
    )


@pytest.mark.slow
def test_a_body_in_tiny_chunks_is_refused(stack: Stack) -> None:
    """1-byte chunks cost the gateway a Python call each: refused once 64 of them came
    in, 400 and closed, and nothing reaches the engine."""
    before = sim_received(stack.sim.url)
    closed = closed_metric(stack.g, "body_chunks_too_small")
    body = chat_body(pad=2000)
    with connect(stack.g.port) as sock:
        started = time.monotonic()
        # Not ended: the answer comes while the client is still sending.
        sock.sendall(chunked_head() + _chunked(body, [], 1)[:-5])
        status, headers, answer = read_response(sock)
        assert time.monotonic() - started < 2
        assert (status, error_code(answer)) == (400, "body_chunks_too_small")
        assert headers["connection"] == "close"
        assert wait_closed(sock, timeout=5)[1] == b""
    # Spelled otherwise, the same.
    with connect(stack.g.port) as sock:
        sock.sendall(chunked_head().replace(b"chunked", b"CHUNKED") + _chunked(body, [], 8))
        status, _, answer = read_response(sock)
        assert (status, error_code(answer)) == (400, "body_chunks_too_small")
    assert closed_metric(stack.g, "body_chunks_too_small") == closed + 2
    assert sim_received(stack.sim.url) == before


@pytest.mark.slow
def test_a_chunked_body_in_usual_chunks_is_forwarded(stack: Stack) -> None:
    """8 KiB chunks, after a few dozen small ones at the start, pass."""
    before = sim_received(stack.sim.url)
    body = chat_body(pad=60_000)
    with connect(stack.g.port) as sock:
        sock.sendall(chunked_head() + _chunked(body, [1] * 40, 8192))
        assert read_response(sock)[0] == 200
    assert sim_received(stack.sim.url) == before + 1


# --- the response ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_client_that_does_not_read_is_dropped(stack: Stack) -> None:
    """Its request leaves the gateway (the in-flight slot is free again) instead of
    waiting on the client forever."""
    stalled = closed_metric(stack.g, "response_stall")
    body = json.dumps(
        {**json.loads(chat_body()), "max_tokens": 30000, "ignore_eos": True, "stream": True}
    ).encode()
    with socket.socket() as sock:
        # A small receive window, so the gateway's buffers fill soon.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", stack.g.port))
        sock.sendall(chat_head(len(body)) + body)
        # Never read; the gateway drops the connection once its buffer stayed full.
        assert wait_for(lambda: closed_metric(stack.g, "response_stall") > stalled, timeout=30)
        assert wait_for(lambda: metric(stack.g.url, "gateway_requests_in_flight") == 0)


# --- the head's size --------------------------------------------------------------------


@pytest.mark.slow
def test_a_head_over_the_byte_cap_is_431_and_closed(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    closed_before = closed_metric(stack.g, "headers_too_large")
    body = chat_body()
    big = "X-Big: " + "a" * MAX_HEADER_BYTES + "\r\n"
    with connect(stack.g.port) as sock:
        sock.sendall(chat_head(len(body), extra=big) + body)
        status, headers, answer = read_response(sock)
        assert (status, error_code(answer)) == (431, "headers_too_large")
        assert headers["connection"] == "close"
        assert wait_closed(sock, timeout=5)[1] == b""
    # Many small headers over the cap, sent in pieces, the head never finished: the
    # answer comes once the cap is passed.
    many = "".join(f"X-Field-{i}: {'v' * 90}\r\n" for i in range(120))
    with connect(stack.g.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        data = many.encode()
        for i in range(0, len(data), 1000):
            sock.sendall(data[i : i + 1000])
            time.sleep(0.01)
        status, _, answer = read_response(sock)
        assert (status, error_code(answer)) == (431, "headers_too_large")
        assert wait_closed(sock, timeout=5)[1] == b""
    # One endless header value: httptools would buffer it whole.
    with connect(stack.g.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Endless: ")
        try:
            for _ in range(100):
                sock.sendall(b"v" * 4096)
        except OSError:
            pass
        status, _, answer = read_response(sock)
        assert (status, error_code(answer)) == (431, "headers_too_large")
    assert sim_received(stack.sim.url) == before
    assert closed_metric(stack.g, "headers_too_large") == closed_before + 3
    # Just under the cap passes.
    fine = "X-Fine: " + "a" * (MAX_HEADER_BYTES - 400) + "\r\n"
    with connect(stack.g.port) as sock:
        sock.sendall(chat_head(len(body), extra=fine) + body)
        assert read_response(sock)[0] == 200


# --- the connection cap -----------------------------------------------------------------


def _streaming(port: int) -> socket.socket:
    """A connection with a streamed chat completion in progress: the answer's head has
    come, the rest is left unread (the gateway's writes pause, the request stays)."""
    body = json.dumps(
        {**json.loads(chat_body()), "max_tokens": 30000, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(chat_head(len(body)) + body)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(1024)
        assert chunk, f"closed before the answer's head: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200 "), got[:100]
    return sock


@pytest.mark.slow
def test_at_the_cap_the_longest_waiting_for_a_head_makes_room(stack: Stack) -> None:
    """Gateway C holds at most 8 connections. At the cap a new connection closes the one
    that has waited longest for a head (oldest first), so a client that sends its head
    at once is served while 8 silent connections are held; a connection with a request
    in progress is never closed for this: with all 8 streaming answers, a 9th connection
    is closed at once, without an answer."""
    evicted = closed_metric(stack.c, "evicted")
    refused = closed_metric(stack.c, "max_connections")
    # Let the scrape's connection close (1 s keep-alive) so the count starts at zero.
    time.sleep(1.5)
    silent = [connect(stack.c.port) for _ in range(MAX_CONNECTIONS)]
    streams: list[socket.socket] = []
    try:
        time.sleep(0.3)
        with connect(stack.c.port) as sock:
            sock.sendall(get())
            assert read_response(sock)[0] == 200
        # The oldest silent connection made room; the next one is still open.
        elapsed, got = wait_closed(silent[0], timeout=5)
        assert elapsed < 2 and got == b""
        silent[1].sendall(get())
        assert read_response(silent[1])[0] == 200
        time.sleep(0.3)
        # Streams take the places of the silent ones, the oldest first (silent[1] went
        # back to waiting after its answer: the last in line, unless its keep-alive
        # ended first).
        for _ in range(MAX_CONNECTIONS):
            streams.append(_streaming(stack.c.port))
        for sock in silent[1:]:
            elapsed, got = wait_closed(sock, timeout=5)
            assert elapsed < 5
        # Every connection has a request in progress: a new one is refused.
        extra = connect(stack.c.port)
        elapsed, got = wait_closed(extra, timeout=5)
        assert elapsed < 2 and got == b""
        extra.close()
        # Room again once one closes.
        streams.pop().close()
        time.sleep(0.5)
        with connect(stack.c.port) as sock:
            sock.sendall(get())
            assert read_response(sock)[0] == 200
    finally:
        for sock in silent + streams:
            sock.close()
    time.sleep(0.5)
    # silent[0], and silent[2:] (silent[1] may have reached its 1 s keep-alive first).
    assert closed_metric(stack.c, "evicted") >= evicted + MAX_CONNECTIONS - 1
    assert closed_metric(stack.c, "max_connections") >= refused + 1


# --- both serving paths -----------------------------------------------------------------


@pytest.mark.slow
def test_limits_hold_under_workers(tmp_path: Path, stack: Stack) -> None:
    """`--workers N` runs the same protocol in every worker."""
    gw = gateway_proc(
        tmp_path, _env(stack.sim, GATEWAY_TIMEOUTS__REQUEST_HEAD="1"), "--workers", "2"
    )
    with running(gw, ready_path="/healthz"):
        socks = [connect(gw.port) for _ in range(4)]
        for sock in socks:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        assert HTTP.get(gw.url + "/healthz").status_code == 200
        for sock in socks:
            elapsed, got = wait_closed(sock)
            assert elapsed <= 4 and got == b""
            sock.close()


# --- the rules, in process --------------------------------------------------------------
