"""What a crafted engine answer can put on a client's connection (found in review).

A raw TCP server on loopback plays the engine and answers by the forwarded `x-scenario`
header; the client side is a raw socket too, so the test sees the exact bytes the
gateway writes (httpx would hide a second head or a stray chunk).

- An engine's chunked trailer fields (after the last chunk) must never become response
  headers: the relay allowlists engine *headers* (headers.py), and a trailer field with
  an allowlisted name (`metadata`, `content-type`) was relayed in the client's head.
- An engine's interim 1xx answer (100 Continue, 103 Early Hints) must not be relayed as
  the final answer: the client got a 1xx head with `transfer-encoding: chunked` and a
  `0\\r\\n\\r\\n` body (a 1xx has no body: a client reading it as an interim answer then
  parses `0` as the next status line), and the engine's real answer was dropped.

Both reproduce on the tree before the speed and store branches as well.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.procs import Proc, gateway_proc

KEY = "sk-engine-answer-framing-0123456789"
MODEL = "scripted/model"
BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()


def _answer(status: str, *headers: str, body: bytes = b"") -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *headers]) + "\r\n\r\n").encode() + body


MODELS = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
JSON = "content-type: application/json"
REAL = _answer("200 OK", JSON, "content-length: 11", body=b'{"real":1}\n')
SCENARIOS = {
    "trailer": _answer(
        "200 OK",
        "content-type: application/json",
        "transfer-encoding: chunked",
        body=b"2\r\n{}\r\n0\r\nmetadata: from-the-trailer\r\nx-after: 1\r\n\r\n",
    ),
    "early-hints": _answer("103 Early Hints", "link: </a.css>") + REAL,
    "continue": _answer("100 Continue") + REAL,
}


def _serve(sock: socket.socket) -> None:
    rfile = sock.makefile("rb")
    try:
        while line := rfile.readline():
            headers: dict[str, str] = {}
            while (h := rfile.readline()) not in (b"\r\n", b""):
                name, _, value = h.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            rfile.read(int(headers.get("content-length", "0")))
            scenario = headers.get("x-scenario", "")
            if scenario in SCENARIOS:
                sock.sendall(SCENARIOS[scenario])
            elif line.split()[1] == b"/v1/models":
                sock.sendall(_answer("200 OK", JSON, f"content-length: {len(MODELS)}", body=MODELS))
            else:
                sock.sendall(_answer("200 OK", JSON, "content-length: 2", body=b"{}"))
    except OSError:
        return
    finally:
        rfile.close()
        sock.close()


@contextmanager
def _engine() -> Iterator[str]:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            _serve(self.request)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp: Path = tmp_path_factory.mktemp("answer-framing")
    with _engine() as engine:
        env = {
            "GATEWAY_ENGINES": json.dumps([engine]),
            "GATEWAY_API_KEYS": json.dumps([KEY]),
            "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
            "GATEWAY_FORWARD_HEADERS": '["x-scenario"]',
            "GATEWAY_TIMEOUTS__IDLE": "2",
        }
        proc = gateway_proc(tmp, env).start("/healthz")
        try:
            yield proc
        finally:
            proc.stop()


def _exchange(gateway: Proc, scenario: str) -> bytes:
    """The raw bytes the client gets for one request with `scenario`, then a second
    request pipelined on the same connection (to see where the first answer ends)."""
    port = int(gateway.url.rsplit(":", 1)[1])
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: gw\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\n"
    )
    first = (head + f"x-scenario: {scenario}\r\n\r\n").encode() + BODY
    second = (head + "connection: close\r\n\r\n").encode() + BODY
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(first + second)
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def test_an_engine_trailer_never_becomes_a_response_header(gateway: Proc) -> None:
    out = _exchange(gateway, "trailer")
    first_head = out.split(b"\r\n\r\n", 1)[0].lower()
    assert b"from-the-trailer" not in first_head, out
    assert b"x-after" not in out.lower()


@pytest.mark.parametrize("scenario", ["early-hints", "continue"])
def test_an_engine_interim_answer_is_not_relayed_as_the_final_one(
    gateway: Proc, scenario: str
) -> None:
    out = _exchange(gateway, scenario)
    # Either the engine's final answer reaches the client, or a gateway error does; never
    # a 1xx head with a chunked body that desynchronises the client's parser.
    assert not out.startswith(b"HTTP/1.1 1"), out
    assert b"\r\n\r\n0\r\n\r\nHTTP/1.1" not in out, out
    # The pipelined request behind it is answered on the same connection.
    assert out.count(b"HTTP/1.1 200 OK") + out.count(b"HTTP/1.1 502") == 2, out
