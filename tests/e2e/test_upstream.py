"""The gateway's upstream client (gateway/upstream/client.py) against a scripted engine.

A raw TCP server on loopback plays the engine and answers each request the way its
`x-scenario` header asks: chunked, read-until-close, `Connection: close`, garbage, a
stall, a short body, an idle connection closed under the gateway, a request dropped
unanswered on a reused connection, a large streamed body, error answers, extra
response headers, a chunked trailer, interim 1xx heads, and 204 and 304 answers that
announce a body (`SCENARIOS`). The gateway runs as a real
process in front of it (one for the whole module), with `x-scenario` added to the
headers it forwards (`forward_headers`). tests/e2e/test_headers.py and
tests/e2e/test_engine_errors.py run their own gateways in front of the same kind of engine.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bench.harness.metrics import HTTP
from tests.procs import Proc, free_port, gateway_proc, owned_response_id, wait_for

KEY = "sk-upstream-0123456789abcdef"
MODEL = "scripted/model"
BIG = 2 * 1024 * 1024
# More than loopback's socket buffers hold (they grow to a few MiB), so a client that
# stops reading makes the gateway's writes wait.
HUGE = 32 * 1024 * 1024


@dataclass
class Seen:
    conn: int
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    index: int = 0  # the request's place on its connection, from 0


@dataclass
class Engine:
    port: int
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, scenario: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.headers.get("x-scenario") == scenario]


def _response(
    body: bytes, *extra: str, status: str = "200 OK", ctype: str = "application/json"
) -> bytes:
    head = [f"HTTP/1.1 {status}", f"content-type: {ctype}", *extra]
    head.append(f"content-length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _chunked(body: bytes, *extra: str, status: str = "200 OK", ctype: str = "") -> bytes:
    head = [f"HTTP/1.1 {status}", f"content-type: {ctype or 'application/json'}", *extra]
    head.append("transfer-encoding: chunked")
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]
    payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


def _vllm_error(status: int, kind: str, message: str, param: str | None = None) -> bytes:
    """An error body as vLLM 0.32 writes it (ErrorResponse)."""
    error = {"message": message, "type": kind, "param": param, "code": status}
    return json.dumps({"error": error}).encode()


# What engines say when something behind them fails: the URL fetched, the address and
# port connected to, an object's memory address (what a bypass turns into a scanner).
LEAKY = (
    "Failed to fetch http://10.1.2.3:8080/x.png (url='http://10.1.2.3:8080/x.png'): "
    "Cannot connect to host internal-db.svc.cluster.local:5432 ssl:default "
    "[Connect call failed ('192.168.7.9', 6379)] and fd00::7; "
    "cannot identify image file <_io.BytesIO object at 0x7f3c2c1d4a40>"
)
LEAKS = ("10.1.2.3", "8080", "internal-db", "5432", "192.168.7.9", "6379", "fd00::7",
         "0x7f3c2c1d4a40", "http://")  # fmt: skip
# Response headers the engine adds on the `headers` scenario: only the allowlisted
# `metadata` (and the content headers) may reach a client.
ENGINE_HEADERS = (
    "endpoint-load-metrics: TEXT kv_cache_usage_perc=0.93, num_requests_waiting=12",
    "x-request-id: engine-chosen-id",
    "server: engine-internal/1.0",
    "set-cookie: engine=1",
    "access-control-allow-origin: *",
    "x-amzn-sagemaker-new-session-id: s-1",
    "cache-control: no-store",
    "x-internal-host: 10.0.0.12",
    'metadata: {"id":"embd-1","data":[{"index":0}]}',
)
HIDDEN_ALIASES = "The model `gone` does not exist. Valid aliases: public, hidden-tenant-model."
SCENARIOS: dict[str, bytes] = {
    # A status no HTTP server has a line for (uvicorn's run from 100 to 599).
    "status-600": _response(b"{}", status="600 Odd"),
    "error-500": _response(
        _vllm_error(500, "InternalServerError", "Traceback: " + LEAKY), status="500 Internal"
    ),
    "error-500-chunked": _chunked(
        _vllm_error(500, "InternalServerError", LEAKY), status="500 Internal"
    ),
    "error-503-text": _response(
        b"engine at 10.0.0.1:9000 is draining", status="503 Unavailable", ctype="text/plain"
    ),
    "error-400": _response(
        _vllm_error(400, "BadRequestError", LEAKY, param="messages"), status="400 Bad Request"
    ),
    "error-400-chunked": _chunked(
        _vllm_error(400, "BadRequestError", LEAKY, param="messages"), status="400 Bad Request"
    ),
    "error-422-nested": _response(
        json.dumps({"detail": [{"loc": ["body", "url"], "msg": LEAKY}, 7, None]}).encode(),
        status="422 Unprocessable",
    ),
    "error-404-html": _response(
        b"<html>no route at 10.0.0.1:80</html>", status="404 Not Found", ctype="text/html"
    ),
    # vLLM 0.32's answer to a model it does not serve, in its three envelopes: OpenAI's,
    # Anthropic's (/v1/messages) and Cohere's (/cohere/v2/*). Each names every alias.
    "error-404-model": _response(
        _vllm_error(404, "NotFoundError", HIDDEN_ALIASES, param="model"), status="404 Not Found"
    ),
    "error-404-model-anthropic": _response(
        json.dumps(
            {"type": "error", "error": {"type": "NotFoundError", "message": HIDDEN_ALIASES}}
        ).encode(),
        status="404 Not Found",
    ),
    "error-404-model-cohere": _response(
        json.dumps({"message": HIDDEN_ALIASES, "id": "r-1"}).encode(), status="404 Not Found"
    ),
    "error-400-big": _response(
        _vllm_error(400, "BadRequestError", "x" * 70_000 + LEAKY), status="400 Bad Request"
    ),
    "headers": _response(b'{"ok":"headers"}', *ENGINE_HEADERS),
    # A successful answer is relayed byte for byte, whatever it says.
    "ok-leaky": _response(json.dumps({"text": LEAKY}).encode()),
    "sse-leaky": _chunked(
        b"data: " + json.dumps({"text": LEAKY}).encode() + b"\n\ndata: [DONE]\n\n",
        ctype="text/event-stream",
    ),
    # Fields after the last chunk (a trailer) with allowlisted names: never headers.
    "trailer": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
    b"2\r\n{}\r\n0\r\nmetadata: from-the-trailer\r\nx-after: 1\r\n\r\n",
    # Interim heads (no body) before the final answer.
    "early-hints": b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n"
    + _response(b'{"real":1}\n'),
    "continue": b"HTTP/1.1 100 Continue\r\n\r\n" + _response(b'{"real":1}\n'),
    # Interim heads with content, which no 1xx has (RFC 9112 6.3); httptools reads it as
    # theirs after a status it does not know (not 100, 102 or 103).
    "interim-content": b"HTTP/1.1 150 Odd\r\ncontent-length: 5\r\n\r\nhello"
    + _response(b'{"real":1}\n'),
    "interim-chunked": b"HTTP/1.1 150 Odd\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\n" + _response(b'{"real":1}\n'),
    # A switch of protocols the gateway never asked for.
    "upgrade": b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
    + _response(b'{"real":1}\n'),
}
# Answers that end with their head whatever their fields say (RFC 9112 6.3): a 204 or a
# 304 with a Content-Length (which a 204 must not have and a 304 may), and with the bytes
# of the body it announced, which are not one.
NO_CONTENT_HEADS = {
    code: f"HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\n".encode()
    for code, reason in ((204, "No Content"), (304, "Not Modified"))
}
for _code, _head in NO_CONTENT_HEADS.items():
    SCENARIOS[f"{_code}-length-0"] = _head + b"content-length: 0\r\n\r\n"
    SCENARIOS[f"{_code}-length-5"] = _head + b"content-length: 5\r\n\r\n"
    SCENARIOS[f"{_code}-body"] = _head + b"content-length: 5\r\n\r\nhello"


def _serve(engine: Engine, conn_id: int, sock: socket.socket) -> None:
    rfile = sock.makefile("rb")
    index = -1
    # Bytes sent ahead of the next answer on this connection (`late-body`).
    stray = b""
    try:
        while True:
            index += 1
            line = rfile.readline()
            if not line:
                return
            method, path, _ = line.decode("latin-1").split(" ", 2)
            headers: dict[str, str] = {}
            while (h := rfile.readline()) not in (b"\r\n", b""):
                name, _, value = h.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = rfile.read(int(headers.get("content-length", "0")))
            with engine.lock:
                engine.seen.append(Seen(conn_id, method, path, headers, body, index))
            if stray:
                sock.sendall(stray)
                stray = b""
            scenario = headers.get("x-scenario", "")
            if scenario == "drop-reused" and index > 0:
                # As uvicorn at its keep-alive timeout: a request arriving on a kept-alive
                # connection is never read, the connection closed without an answer.
                return
            # An engine served under /prefix (test_engine_under_a_path_prefix) too.
            path = path.removeprefix("/prefix")
            if path == "/health":
                sock.sendall(_response(b"{}"))
            elif path == "/v1/models" and not scenario:
                sock.sendall(_response(b'{"object":"list","data":[{"id":"%s"}]}' % MODEL.encode()))
            elif scenario == "chunked":
                chunks = [b"abc", b"defg", b"hi"]
                payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
                sock.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + payload)
            elif scenario == "eof":
                sock.sendall(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil-the-end")
                return
            elif scenario == "close":
                sock.sendall(_response(b'{"closing":true}', "connection: close"))
                return
            elif scenario == "garbage":
                sock.sendall(b"SPAM SPAM SPAM\r\n\r\n")
                return
            elif scenario == "hang-up":
                return  # reads the request, closes the fresh connection without a byte
            elif scenario == "stall":
                time.sleep(3)
                return
            elif scenario == "short":
                sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                return
            elif scenario == "stall-mid":
                # Starts a small answer, then goes quiet past the gateway's idle timeout.
                sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                time.sleep(3)
                return
            elif scenario == "stall-mid-sse":
                sock.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n"
                    % (12, b"data: {}\n\n\n\n")
                )
                time.sleep(3)
                return
            elif scenario == "idle-close":
                sock.sendall(_response(b'{"ok":1}'))
                time.sleep(0.1)
                return  # closes the keep-alive connection while the gateway holds it
            elif scenario in ("204-late-body", "304-late-body"):
                # A 204 or 304 announcing 5 bytes, which come once the next request is
                # written on the connection: the start of that request's answer.
                sock.sendall(NO_CONTENT_HEADS[int(scenario[:3])] + b"content-length: 5\r\n\r\n")
                stray = b"hello"
            elif scenario in SCENARIOS:
                sock.sendall(SCENARIOS[scenario])
            elif scenario in ("big", "huge"):
                sock.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                piece = b"x" * 65536
                for _ in range((BIG if scenario == "big" else HUGE) // len(piece)):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sock.sendall(b"0\r\n\r\n")
            else:
                sock.sendall(_response(b'{"ok":true}'))
    except OSError:
        return
    finally:
        rfile.close()
        sock.close()


@contextmanager
def scripted_engine() -> Iterator[Engine]:
    """The scripted engine, on a free loopback port."""
    counter = iter(range(1, 1_000_000))
    holder: list[Engine] = []

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            _serve(holder[0], next(counter), self.request)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", free_port()), Handler)
    server.daemon_threads = True
    holder.append(Engine(server.server_address[1]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with scripted_engine() as e:
        yield e


@contextmanager
def scripted_gateway(engine: Engine, tmp: Path, key: str = KEY, **env: str) -> Iterator[Proc]:
    """The gateway under uvicorn before the scripted engine, which picks its answer by
    the X-Scenario header (forwarded for it alone)."""
    base = {
        "GATEWAY_ENGINES": f'["{engine.url}"]',
        "GATEWAY_API_KEYS": f'["{key}"]',
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        "GATEWAY_FORWARD_HEADERS": '["x-scenario"]',
    }
    proc = gateway_proc(tmp, {**base, **env})
    proc.start("/healthz")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp: Path = tmp_path_factory.mktemp("upstream")
    env = {"GATEWAY_TIMEOUTS__FIRST_BYTE": "1", "GATEWAY_TIMEOUTS__IDLE": "1"}
    with scripted_gateway(engine, tmp, **env) as proc:
        yield proc


def post_scenario(gateway: Proc, scenario: str, body: bytes, timeout: float = 5) -> httpx.Response:
    headers = {
        "Authorization": f"Bearer {KEY}",
        "Content-Type": "application/json",
        "X-Scenario": scenario,
    }
    return HTTP.post(
        gateway.url + "/v1/completions", content=body, headers=headers, timeout=timeout
    )


def _get(gateway: Proc, scenario: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "X-Scenario": scenario}
    # /load: a GET the gateway relays as the engine sends it (a model list is parsed).
    return HTTP.get(gateway.url + "/load", headers=headers, timeout=10)


def _errors_logged(gateway: Proc, since: int, last: httpx.Response) -> list[str]:
    """What the gateway logged as an error from offset `since` of its log up to the
    line of the request `last` answered: its own lines at level error (unhandled_error),
    and every line not in its JSON format (uvicorn's and uvloop's error reports)."""
    request_id = last.headers["x-request-id"]
    marker = '"event":"request"'

    def lines() -> list[str]:
        out: list[str] = []
        for line in gateway.log()[since:].splitlines():
            out.append(line)
            if marker in line and json.loads(line).get("request_id") == request_id:
                return out
        return []

    assert wait_for(lambda: bool(lines())), gateway.log_tail()
    return [
        line
        for line in lines()
        if not line.startswith("{") or json.loads(line).get("level") == "error"
    ]


@pytest.mark.slow
def test_request_as_the_engine_sees_it(engine: Engine, gateway: Proc) -> None:
    body = b'{"model": "scripted/model",   "prompt": "exact bytes \\u00e9"}'
    r = post_scenario(gateway, "shape", body)
    assert r.status_code == 200 and r.json() == {"ok": True}
    seen = engine.requests("shape")[-1]
    assert (seen.method, seen.path, seen.body) == ("POST", "/v1/completions", body)
    assert seen.headers["host"] == f"127.0.0.1:{engine.port}"
    assert seen.headers["content-length"] == str(len(body))
    assert "authorization" not in seen.headers and "transfer-encoding" not in seen.headers
    assert seen.headers["x-request-id"] == r.headers["x-request-id"]


@pytest.mark.slow
def test_large_body_is_forwarded_intact(engine: Engine, gateway: Proc) -> None:
    prompt = "".join(chr(0x41 + i % 26) for i in range(1_500_000))
    body = b'{"model": "scripted/model", "prompt": "%s"}' % prompt.encode()
    r = post_scenario(gateway, "large-body", body, timeout=10)
    assert r.status_code == 200
    seen = engine.requests("large-body")[-1]
    assert seen.body == body and seen.headers["content-length"] == str(len(body))


@pytest.mark.slow
def test_keep_alive_reuses_one_connection(engine: Engine, gateway: Proc) -> None:
    for _ in range(10):
        assert _get(gateway, "reuse").status_code == 200
    assert len({s.conn for s in engine.requests("reuse")}) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "body"),
    [("chunked", b"abcdefghi"), ("eof", b"until-the-end"), ("close", b'{"closing":true}')],
)
def test_response_framings(engine: Engine, gateway: Proc, scenario: str, body: bytes) -> None:
    r = _get(gateway, scenario)
    assert (r.status_code, r.content) == (200, body)
    # The connection the engine closed (or that ended the body) is not reused.
    assert _get(gateway, "after-" + scenario).status_code == 200


@pytest.mark.slow
def test_large_streamed_body_arrives_whole(gateway: Proc) -> None:
    r = _get(gateway, "big")
    assert r.status_code == 200 and len(r.content) == BIG and set(r.content) == {ord("x")}


@pytest.mark.slow
def test_idle_connection_closed_by_the_engine_is_not_reused(engine: Engine, gateway: Proc) -> None:
    assert _get(gateway, "idle-close").status_code == 200
    time.sleep(0.4)
    assert _get(gateway, "after-idle").status_code == 200
    first, second = engine.requests("idle-close")[-1], engine.requests("after-idle")[-1]
    assert first.conn != second.conn


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "status", "code"),
    [
        ("garbage", 502, "upstream_unavailable"),
        ("hang-up", 502, "upstream_unavailable"),
        ("status-600", 502, "upstream_unavailable"),
        # Content in a 1xx: httptools read it as the interim head's, and it was fed to
        # the final answer, longer then than its Content-Length (an unhandled_error).
        ("interim-content", 502, "upstream_unavailable"),
        ("interim-chunked", 502, "upstream_unavailable"),
        # httptools stops at a 101 with its own exception, which escaped the client's
        # data_received: uvloop logged a fatal transport error.
        ("upgrade", 502, "upstream_unavailable"),
        ("stall", 504, "upstream_timeout"),
        ("short", 502, "upstream_broken"),
        # A small answer that stalls is a timeout, as a streamed one is (it was 502).
        ("stall-mid", 504, "upstream_timeout"),
    ],
)
def test_upstream_failures_are_clear_errors(
    gateway: Proc, scenario: str, status: int, code: str
) -> None:
    """GET and POST alike. Compiled (scripts/compile.py), the failover loop once bound
    one exception variable to the type of its first `except` clause: every failure
    before an answer other than a refused connection became a TypeError, a 500."""
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    since = len(gateway.log())
    for r in (_get(gateway, scenario), post_scenario(gateway, scenario, body)):
        assert (r.status_code, r.json()["error"]["code"]) == (status, code)
        # No library text reaches the client.
        assert "httptools" not in r.text and "Error" not in r.json()["error"]["message"]
    after = _get(gateway, "after-" + scenario)
    assert after.status_code == 200
    assert _errors_logged(gateway, since, after) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario",
    ["204-length-0", "204-length-5", "204-body", "304-length-0", "304-length-5", "304-body"],
)
def test_an_answer_that_ends_with_its_head_is_relayed_as_one(
    engine: Engine, gateway: Proc, scenario: str
) -> None:
    """A 204 or 304 is its head alone, whatever Content-Length it carries: the client
    gets the status and the allowlisted headers without one (a 204 may not have it; a
    304's would be the length of a body it does not get). The engine's Content-Length
    once went along, and uvicorn, waiting for that many bytes, logged unhandled_error."""
    status = int(scenario[:3])
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    since = len(gateway.log())
    for r in (_get(gateway, scenario), post_scenario(gateway, scenario, body)):
        assert (r.status_code, r.content) == (status, b"")
        assert r.headers["content-type"] == "application/json"
        assert "content-length" not in r.headers and "transfer-encoding" not in r.headers
    assert [s.method for s in engine.requests(scenario)[-2:]] == ["GET", "POST"]
    after = _get(gateway, "after-" + scenario)
    assert (after.status_code, after.json()) == (200, {"ok": True})
    assert _errors_logged(gateway, since, after) == []


@pytest.mark.slow
@pytest.mark.parametrize("status", [204, 304])
def test_a_connection_whose_no_content_answer_announced_a_body_is_not_reused(
    engine: Engine, gateway: Proc, status: int
) -> None:
    """The engine announces 5 bytes of body with its 204 or 304 and sends them after
    the next request written on that connection: read as HTTP frames it, they start that
    request's answer, which is then invalid. Reused, the connection failed the next
    request (502); it is closed instead, and the next request gets its answer."""
    scenario = f"{status}-late-body"
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    since = len(gateway.log())
    sends = {
        "GET": lambda: _get(gateway, scenario),
        "POST": lambda: post_scenario(gateway, scenario, body),
    }
    for method, send in sends.items():
        r = send()
        assert (r.status_code, r.content) == (status, b"")
        assert "content-length" not in r.headers
        after = _get(gateway, "after-" + scenario)
        assert (after.status_code, after.json()) == (200, {"ok": True})
        late, next_one = engine.requests(scenario)[-1], engine.requests("after-" + scenario)[-1]
        assert late.method == method and next_one.conn != late.conn
    assert _errors_logged(gateway, since, after) == []


@pytest.mark.slow
def test_engine_under_a_path_prefix(engine: Engine, tmp_path: Path) -> None:
    env = {
        "GATEWAY_ENGINES": f'["{engine.url}/prefix/"]',
        "GATEWAY_API_KEYS": f'["{KEY}"]',
        "GATEWAY_FORWARD_HEADERS": '["x-scenario"]',
        "GATEWAY_PAYLOAD__NAMESPACE_SECRET": "prefix-namespace-secret",
    }
    proc = gateway_proc(tmp_path, env)
    # Ready: the health check and the model list went under the prefix too.
    proc.start("/readyz")
    response = "/v1/responses/" + owned_response_id(KEY, "prefix-namespace-secret")
    try:
        headers = {"Authorization": f"Bearer {KEY}", "X-Scenario": "prefixed"}
        r = HTTP.get(proc.url + "/load", headers=headers, timeout=10)
        # The only forwarded route with a query: it follows the prefixed path.
        r2 = HTTP.get(proc.url + response + "?stream=1", headers=headers, timeout=10)
    finally:
        proc.stop()
    assert r.status_code == 200 and r2.status_code == 200
    paths = [seen.path for seen in engine.requests("prefixed")[-2:]]
    assert paths == ["/prefix/load", f"/prefix{response}?stream=true"]


@pytest.mark.slow
def test_a_reused_connection_closed_without_an_answer_is_retried_fresh(
    engine: Engine, tmp_path: Path
) -> None:
    """Every request on a reused connection is dropped unanswered: the gateway sends it
    once more on a fresh connection to the same engine, GET and POST alike, and does not
    count it against the engine (one failure of any key would eject it here)."""
    env = {
        "GATEWAY_ENGINES": f'["{engine.url}"]',
        "GATEWAY_API_KEYS": f'["{KEY}"]',
        "GATEWAY_FORWARD_HEADERS": '["x-scenario"]',
        "GATEWAY_PUBLIC_METRICS": "true",
        "GATEWAY_ROUTING__EJECT_AFTER_5XX": "1",
        "GATEWAY_ROUTING__EJECT_KEYS": "1",
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
    }
    proc = gateway_proc(tmp_path, env)
    proc.start("/readyz")
    headers = {"Authorization": f"Bearer {KEY}", "X-Scenario": "drop-reused"}
    body = {"model": MODEL, "prompt": "hi"}
    try:
        with httpx.Client(timeout=10) as client:
            for _ in range(3):
                r = client.get(proc.url + "/load", headers=headers)
                assert r.status_code == 200, r.text
                r = client.post(proc.url + "/v1/completions", headers=headers, json=body)
                assert (r.status_code, r.json()) == (200, {"ok": True})
            ready = client.get(proc.url + "/readyz").json()
            metrics = client.get(proc.url + "/metrics").text
    finally:
        proc.stop()
    by_id: dict[str, list[Seen]] = {}
    for seen in engine.requests("drop-reused"):
        by_id.setdefault(seen.headers["x-request-id"], []).append(seen)
    assert len(by_id) == 6
    retried = [s for s in by_id.values() if len(s) == 2]
    # The gateway's connection was kept alive between requests: most went out on it,
    # were dropped, and went again, first on a new connection. None went three times.
    assert len(retried) >= 5 and all(len(s) <= 2 for s in by_id.values())
    for dropped, again in retried:
        assert dropped.index > 0 and again.index == 0 and dropped.conn != again.conn
        assert (dropped.method, dropped.body) == (again.method, again.body)
    assert ready["healthy_engines"] == 1
    assert f'gateway_engine_ejections_total{{engine="{engine.url}"}} 0.0' in metrics


@pytest.mark.slow
def test_a_stream_that_stalls_ends_with_a_timeout_frame(gateway: Proc) -> None:
    with HTTP.stream(
        "GET",
        gateway.url + "/load",
        headers={"Authorization": f"Bearer {KEY}", "X-Scenario": "stall-mid-sse"},
        timeout=10,
    ) as r:
        body = r.read()
    assert r.status_code == 200
    assert body.startswith(b"data: {}")
    assert b'"code":"upstream_timeout"' in body


@pytest.mark.slow
def test_a_slow_client_is_not_blamed_on_the_engine(gateway: Proc) -> None:
    """The idle timeout (1 s here) is the engine's silence: a client that stops reading
    for longer still gets the whole answer once it reads again."""
    host, port = "127.0.0.1", int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"GET /load HTTP/1.1\r\nHost: gw\r\nX-Scenario: huge\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nConnection: close\r\n\r\n"
        )
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(2.5)  # the gateway's writes back up meanwhile
        received = bytearray(first)
        while chunk := sock.recv(1 << 16):
            received += chunk
    assert received.endswith(b"0\r\n\r\n"), bytes(received[-200:])
    assert received.count(b"x") >= HUGE


def _exchange(gateway: Proc, scenario: str) -> bytes:
    """The raw bytes a client gets for one request with `scenario`, then for a second
    request pipelined on the same connection (to see where the first answer ends):
    httpx would hide a second head or a stray chunk."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    )
    first = (head + f"x-scenario: {scenario}\r\n\r\n").encode() + body
    second = (head + "connection: close\r\n\r\n").encode() + body
    out = b""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(first + second)
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


@pytest.mark.slow
def test_an_engine_trailer_never_becomes_a_response_header(gateway: Proc) -> None:
    """The relay allowlists engine *headers* (headers.py); a trailer field with an
    allowlisted name (`metadata`) once reached the client's head."""
    out = _exchange(gateway, "trailer")
    first_head = out.split(b"\r\n\r\n", 1)[0].lower()
    assert b"from-the-trailer" not in first_head, out
    assert b"x-after" not in out.lower()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["early-hints", "continue"])
def test_an_engine_interim_answer_is_not_relayed_as_the_final_one(
    gateway: Proc, scenario: str
) -> None:
    """A 1xx once went to the client as the final answer, with a chunked `0` body that
    desynchronised its parser, and the engine's real answer was dropped."""
    out = _exchange(gateway, scenario)
    assert not out.startswith(b"HTTP/1.1 1"), out
    assert b"\r\n\r\n0\r\n\r\nHTTP/1.1" not in out, out
    # The pipelined request behind it is answered on the same connection.
    assert out.count(b"HTTP/1.1 200 OK") + out.count(b"HTTP/1.1 502") == 2, out
