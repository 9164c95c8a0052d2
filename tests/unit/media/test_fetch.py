"""The safe fetcher against real servers on loopback: a media origin (reachable only
through ALLOWED_NETWORKS) and canaries that must never be contacted."""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import AsyncIterator, Iterator, Sequence

import httpx
import pytest

from bench.harness.samples import png
from gateway.errors import MediaFetchFailed, MediaTooLarge
from gateway.media.addresses import Address
from gateway.media.fetch import FetchAllowance, MediaFetcher
from gateway.media.settings import MediaSettings
from gateway.media.urls import RemoteUrl, UrlPolicy
from tests.procs import RecordingServer, Route, SocketCanary, free_port

PNG = png()

# The reason names the setting that allows an address, and nothing of the address.
REFUSED = r"\(reason: address refused: .* media\.allowed_networks\)"


class Chunks(httpx.AsyncByteStream):
    """`data` in 1 KiB pieces."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), 1024):
            yield self.data[i : i + 1024]


# The time cap of the fetch that /slow outlasts (it answers after four times as long).
SLOW_TIMEOUT = 0.5


class ChunkedForever:
    """Answers 200 with a chunked body that never ends (no Content-Length)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", free_port()))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
            chunk = b"x" * 4096
            while True:
                conn.sendall(b"1000\r\n" + chunk + b"\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def origin(canary: RecordingServer) -> Iterator[RecordingServer]:
    routes = {
        "/img.png": Route(body=PNG, headers={"Content-Type": "image/png"}),
        "/redirect": Route(status=302, headers={"Location": canary.url + "/stolen"}),
        "/moved": Route(status=301, headers={"Location": canary.url + "/stolen"}),
        "/gzip": Route(body=PNG, headers={"Content-Type": "image/png", "Content-Encoding": "gzip"}),
        "/slow": Route(body=PNG, delay=4 * SLOW_TIMEOUT, headers={"Content-Type": "image/png"}),
        "/big": Route(body=b"x" * 5000, headers={"Content-Type": "image/png"}),
        "/error": Route(status=500, body=b"boom"),
    }
    with RecordingServer(routes) as server:
        yield server


class StaticResolver:
    def __init__(self, *answers: Sequence[str]) -> None:
        self.answers = [[ipaddress.ip_address(a) for a in group] for group in answers]
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[Address]:
        self.calls.append(host)
        index = min(len(self.calls), len(self.answers)) - 1
        return list(self.answers[index])


def settings(port: int, **overrides: object) -> MediaSettings:
    base: dict[str, object] = {
        "allowed_domains": [f"127.0.0.1:{port}", f"origin.test:{port}", f"rebind.test:{port}"],
        "allowed_schemes": ["http"],
        "allowed_networks": ["127.0.0.0/8"],
        # Far longer than any answer here takes on a loaded machine: the one test of the
        # cap sets its own, shorter than its origin's delay (SLOW_TIMEOUT).
        "fetch_timeout": 10.0,
        "max_bytes": 4000,
    }
    base.update(overrides)
    return MediaSettings.model_validate(base)


def url(s: MediaSettings, raw: str) -> RemoteUrl:
    ref = UrlPolicy(s).check(raw)
    assert isinstance(ref, RemoteUrl)
    return ref


async def fetch(s: MediaSettings, raw: str, resolver: StaticResolver | None = None) -> bytes:
    fetcher = MediaFetcher(s, resolver=resolver)
    try:
        return (await fetcher.fetch(url(s, raw))).data
    finally:
        await fetcher.aclose()


async def test_fetches_from_an_allowed_origin_with_identity_encoding(
    origin: RecordingServer,
) -> None:
    s = settings(origin.port)
    resolver = StaticResolver(["127.0.0.1"])
    before = len(origin.hits)
    data = await fetch(s, f"http://origin.test:{origin.port}/img.png", resolver)
    assert data == PNG
    hit = origin.hits[before]
    headers = {k.lower(): v for k, v in hit.headers.items()}
    # Connected to the checked IP, but the request still names the host.
    assert headers["host"] == f"origin.test:{origin.port}"
    assert headers["accept-encoding"] == "identity"
    assert resolver.calls == ["origin.test"]


@pytest.mark.parametrize("path", ["/redirect", "/moved"])
async def test_redirects_are_refused_and_never_followed(
    origin: RecordingServer, canary: RecordingServer, path: str
) -> None:
    s = settings(origin.port)
    with pytest.raises(MediaFetchFailed, match="reason: redirect") as info:
        await fetch(s, f"http://127.0.0.1:{origin.port}{path}")
    assert info.value.status == 422 and info.value.code == "media_fetch_failed"
    assert not canary.contacted


@pytest.mark.parametrize(
    ("answers", "networks"),
    [
        (["127.0.0.1"], []),  # loopback without an opt-in
        (["8.8.8.8", "127.0.0.1"], ["8.8.8.8/32"]),  # one bad answer spoils the set
        (["::1"], ["127.0.0.0/8"]),
        (["::ffff:127.0.0.1"], ["127.0.0.0/8"]),
        (["169.254.169.254"], ["127.0.0.0/8"]),
        (["10.1.2.3"], []),
    ],
)
async def test_non_public_answers_are_refused_before_connecting(
    answers: list[str], networks: list[str]
) -> None:
    target = SocketCanary()
    try:
        s = settings(target.port, allowed_networks=networks)
        with pytest.raises(MediaFetchFailed, match=REFUSED):
            await fetch(s, f"http://origin.test:{target.port}/img.png", StaticResolver(answers))
        assert target.accepted == 0
    finally:
        target.close()


async def test_ip_literal_hosts_still_pass_the_address_check() -> None:
    target = SocketCanary()
    try:
        s = settings(target.port, allowed_networks=[])
        with pytest.raises(MediaFetchFailed, match=REFUSED):
            await fetch(s, f"http://127.0.0.1:{target.port}/img.png")
        assert target.accepted == 0
    finally:
        target.close()


def _pair_on_same_port() -> tuple[RecordingServer, SocketCanary]:
    for _ in range(20):
        good = RecordingServer({"/img.png": Route(body=PNG, headers={"Content-Type": "image/png"})},
                               host="127.0.0.2")  # fmt: skip
        try:
            return good, SocketCanary("127.0.0.1", good.port)
        except OSError:
            good._server.server_close()
    raise RuntimeError("no free port pair")


async def test_dns_rebinding_cannot_move_the_connection() -> None:
    # The name answers an allowed address first and the private canary afterwards.
    good, private = _pair_on_same_port()
    with good:
        try:
            s = settings(good.port, allowed_networks=["127.0.0.2/32"])
            resolver = StaticResolver(["127.0.0.2"], ["127.0.0.1"])
            fetcher = MediaFetcher(s, resolver=resolver)
            try:
                target = url(s, f"http://rebind.test:{good.port}/img.png")
                assert (await fetcher.fetch(target)).data == PNG
                assert resolver.calls == ["rebind.test"]  # resolved once for the fetch
                with pytest.raises(MediaFetchFailed, match=REFUSED):
                    await fetcher.fetch(target)
            finally:
                await fetcher.aclose()
            assert len(good.hits) == 1
            assert private.accepted == 0
        finally:
            private.close()


async def test_dns_failure_is_a_fetch_failure() -> None:
    async def broken(host: str, port: int) -> list[Address]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    s = settings(9)
    fetcher = MediaFetcher(s, resolver=broken)
    try:
        with pytest.raises(MediaFetchFailed, match="reason: dns") as info:
            await fetcher.fetch(url(s, "http://origin.test:9/img.png"))
        assert "Name or service" not in info.value.message
    finally:
        await fetcher.aclose()


@pytest.mark.parametrize(
    ("path", "reason"),
    [("/big", "size"), ("/slow", "timeout"), ("/error", "status 500"),
     ("/missing", "status 418"), ("/gzip", "content encoding")],
)  # fmt: skip
async def test_fetch_failures_name_their_reason(
    origin: RecordingServer, path: str, reason: str
) -> None:
    # Only /slow is cut by the time cap; the others answer at once and are refused for
    # what they are (a size cap is not raced against the time cap).
    timeout = {"fetch_timeout": SLOW_TIMEOUT} if reason == "timeout" else {}
    s = settings(origin.port, **timeout)
    with pytest.raises(MediaFetchFailed, match=f"reason: {reason}"):
        await fetch(s, f"http://127.0.0.1:{origin.port}{path}")


async def test_a_body_without_length_is_capped_while_streaming() -> None:
    server = ChunkedForever()
    try:
        s = settings(server.port, fetch_timeout=5.0)
        with pytest.raises(MediaFetchFailed, match="reason: size"):
            await fetch(s, f"http://127.0.0.1:{server.port}/img.png")
    finally:
        server.close()


async def test_bytes_beyond_an_announced_length_are_charged_as_they_come() -> None:
    # The inner transport swapped (no HTTP/1.1 client reads past a Content-Length it
    # believes, and one framed by chunks as well is refused: the next test): the
    # allowance is charged the length at once, then every byte past it as it arrives.
    body = PNG * 8

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Length": "1"}, stream=Chunks(body))

    s = settings(9, max_bytes=len(body) + 1)
    fetcher = MediaFetcher(s, transport=httpx.MockTransport(answer))
    try:
        allowance = FetchAllowance(len(body) + 10)
        assert (await fetcher.fetch(url(s, "http://127.0.0.1:9/a.png"), "", allowance)).data == body
        assert allowance.remaining == 10
        with pytest.raises(MediaTooLarge):
            await fetcher.fetch(url(s, "http://127.0.0.1:9/b.png"), "", FetchAllowance(len(PNG)))
    finally:
        await fetcher.aclose()


async def test_an_answer_framed_by_a_length_and_chunks_is_refused() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"Content-Length": "1", "Transfer-Encoding": "chunked"}
        return httpx.Response(200, headers=headers, stream=Chunks(PNG))

    s = settings(9)
    fetcher = MediaFetcher(s, transport=httpx.MockTransport(answer))
    try:
        with pytest.raises(MediaFetchFailed, match="reason: framing"):
            await fetcher.fetch(url(s, "http://127.0.0.1:9/a.png"), "", FetchAllowance(10**6))
    finally:
        await fetcher.aclose()


async def test_proxy_environment_variables_are_ignored(
    origin: RecordingServer, canary: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, canary.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    data = await fetch(settings(origin.port), f"http://127.0.0.1:{origin.port}/img.png")
    assert data == PNG
    assert not canary.contacted


class RecordingInner(httpx.AsyncBaseTransport):
    """Stands in for the network below SafeTransport (the code under test), recording
    what SafeTransport asks it to connect to."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(200, headers={"Content-Type": "image/png"}, stream=OneChunk())


class OneChunk(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield PNG


@pytest.mark.parametrize(("answer", "network"), [("127.0.0.1", "127.0.0.0/8"), ("::1", "::1/128")])
async def test_https_connects_to_the_checked_ip_with_the_name_for_sni(
    answer: str, network: str
) -> None:
    s = MediaSettings(
        allowed_domains=["images.example"], allowed_networks=[network], fetch_timeout=2.0
    )
    inner = RecordingInner()
    fetcher = MediaFetcher(s, transport=inner, resolver=StaticResolver([answer]))
    try:
        data = await fetcher.fetch(url(s, "https://images.example/a.png?x=1"))
    finally:
        await fetcher.aclose()
    assert data.data == PNG
    (sent,) = inner.requests
    assert sent.url.host == answer and sent.url.scheme == "https"
    assert sent.url.raw_path == b"/a.png?x=1"
    assert sent.extensions["sni_hostname"] == "images.example"
    assert sent.headers["host"] == "images.example"
