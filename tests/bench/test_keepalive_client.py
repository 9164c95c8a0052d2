"""bench/suites/loadgen.py's KeepAliveClient keeps its connection while the server does: the
1-connection latency figures are meant to measure requests, not connection setup."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from bench.harness.server import free_port
from bench.suites.loadgen import KeepAliveClient

REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


class Answering:
    """A loopback server answering every request with `answer`, counting connections."""

    def __init__(self, answer: bytes, close_idle: bool = False) -> None:
        self.answer = answer
        # Close every connection after its answer without saying so, as a server whose
        # keep-alive timeout ran out while the client sat idle.
        self.close_idle = close_idle
        self.accepted = 0
        self.sock = socket.create_server(("127.0.0.1", free_port()))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
                while b"\r\n\r\n" in buffer:
                    _, buffer = buffer.split(b"\r\n\r\n", 1)
                    conn.sendall(self.answer)
                    if self.close_idle or b"connection: close" in self.answer.lower():
                        return


@pytest.fixture
def servers() -> Iterator[list[Answering]]:
    made: list[Answering] = []
    yield made
    for s in made:
        s.sock.close()


@pytest.mark.parametrize(
    ("answer", "connections"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 1),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", 1),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", 5),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 5),
    ],
)
def test_one_connection_while_the_server_keeps_it(
    servers: list[Answering], answer: bytes, connections: int
) -> None:
    server = Answering(answer)
    servers.append(server)
    with KeepAliveClient("127.0.0.1", server.port, timeout=10) as client:
        for _ in range(5):
            response = client.send(REQUEST)
            assert (response.status, response.body) == (200, b"ok")
    assert server.accepted == connections


def test_a_connection_the_server_closed_while_idle_is_replaced(
    servers: list[Answering],
) -> None:
    server = Answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", close_idle=True)
    servers.append(server)
    with KeepAliveClient("127.0.0.1", server.port, timeout=10) as client:
        for _ in range(5):
            response = client.send(REQUEST)
            assert (response.status, response.body) == (200, b"ok")
    assert server.accepted == 5


def test_a_fresh_connection_closed_before_the_answer_is_an_error(
    servers: list[Answering],
) -> None:
    server = Answering(b"", close_idle=True)
    servers.append(server)
    with (
        KeepAliveClient("127.0.0.1", server.port, timeout=10) as client,
        pytest.raises(ConnectionError),
    ):
        client.send(REQUEST)
    # Sent once: a connection just opened is not retried.
    assert server.accepted == 1
