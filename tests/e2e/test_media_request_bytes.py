"""The bytes one request's media URLs may bring in (`media.max_request_fetch_bytes`),
through the gateway under uvicorn: every fetched item is inlined into the forwarded
body, and 32 URLs of 19 MiB files took the gateway to 1.8 GB for one request."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.origin import QuietHandler, ThreadedServer
from bench.harness.samples import png
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    MediaStack,
    RecordingServer,
    Route,
    gateway_proc,
    media_gateway_env,
    running,
    sim_proc,
    sim_received,
)

KEY = "sk-media-bytes-0123456789abcdef"
ITEM_BYTES = 40_000
# Two items fit, a third does not.
LIMIT = 2 * ITEM_BYTES + ITEM_BYTES // 2


def padded_png(size: int) -> bytes:
    """A small valid PNG made `size` bytes long by a text chunk after its header."""
    image = png(8, 8)
    pad = size - len(image) - 12 - len(b"Comment\x00")
    data = b"Comment\x00" + b"z" * pad
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + data) & 0xFFFFFFFF)
    return image[:33] + chunk + image[33:]


Stack = MediaStack[RecordingServer]
OriginT = TypeVar("OriginT", RecordingServer, ThreadedServer)
IMAGE = padded_png(ITEM_BYTES)


class ChunksUnderALength(QuietHandler):
    """An origin that answers every GET with IMAGE in chunks under `Content-Length: 1`:
    HTTP/1.1 clients take the chunks (Transfer-Encoding wins), whatever the length says."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", "1")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(0, len(IMAGE), 8192):
            piece = IMAGE[i : i + 8192]
            self.wfile.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True


@contextmanager
def in_front_of(tmp: Path, origin: OriginT) -> Iterator[MediaStack[OriginT]]:
    """A simulated engine and the gateway, allowed to fetch from `origin`, under the
    request allowance LIMIT."""
    host = origin.url.split("//", 1)[1]
    sim = sim_proc(tmp, "--latency", "zero")
    env = media_gateway_env(
        sim.url, KEY, host, "http", GATEWAY_MEDIA__MAX_REQUEST_FETCH_BYTES=str(LIMIT)
    )
    gw = gateway_proc(tmp, env)
    with running(sim, ready_path="/health"), running(gw, ready_path="/readyz"):
        yield MediaStack(sim, gw, origin)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("media-bytes")
    assert len(IMAGE) == ITEM_BYTES
    route = Route(body=IMAGE, headers={"Content-Type": "image/png"})
    origins = RecordingServer({f"/{n}.png": route for n in "abcd"})
    with origins as origin, in_front_of(tmp, origin) as stack:
        yield stack


def ask(stack: MediaStack[Any], names: str) -> httpx.Response:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"{stack.origin.url}/{n}.png"}} for n in names
    ]
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": "?"}]}],
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    return HTTP.post(
        stack.gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
    )


@pytest.mark.slow
def test_media_urls_over_the_request_allowance_are_refused(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    resp = ask(stack, "abc")
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == "media_too_large"
    assert sim_received(stack.sim.url) == before


@pytest.mark.slow
def test_media_urls_within_the_allowance_are_forwarded(stack: Stack) -> None:
    before = sim_received(stack.sim.url)
    resp = ask(stack, "ab")
    assert resp.status_code == 200, resp.text
    assert sim_received(stack.sim.url) == before + 1


@pytest.mark.slow
def test_cached_items_count_against_the_allowance(stack: Stack) -> None:
    # a and b are cached now (the previous test); with d they are over the allowance.
    assert ask(stack, "ab").status_code == 200
    fetched = len(stack.origin.hits)
    before = sim_received(stack.sim.url)
    resp = ask(stack, "abd")
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == "media_too_large"
    assert sim_received(stack.sim.url) == before
    # a and b came from the cache: at most d was fetched.
    assert len(stack.origin.hits) <= fetched + 1


@pytest.mark.slow
def test_an_answer_framed_by_a_length_and_chunks_is_refused(tmp_path: Path) -> None:
    # Content-Length: 1 with chunks: an HTTP/1.1 client reads the chunks (Transfer-Encoding
    # wins). The announced length was charged and the stream taken as capped at it, so
    # each item came in for one byte of the allowance (15 MiB for 1 byte in process; 32
    # items of 20 MiB a request). Such an answer is refused now, before its body is read.
    with ThreadedServer(ChunksUnderALength) as origin, in_front_of(tmp_path, origin) as stack:
        before = sim_received(stack.sim.url)
        for names in ("a", "cde"):
            resp = ask(stack, names)
            assert resp.status_code == 422, resp.text
            assert resp.json()["error"]["code"] == "media_fetch_failed"
            assert "framing" in resp.json()["error"]["message"]
        assert sim_received(stack.sim.url) == before
