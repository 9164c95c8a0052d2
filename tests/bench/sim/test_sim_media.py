"""Media in the simulated engine: it fetches like a DEFAULT vLLM, which is the hole the
gateway closes. Canaries here are expected to be contacted, except where a flag says no."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.samples import data_url, png
from bench.sim import guard
from bench.sim.app import SimApp
from bench.sim.config import SimConfig, parse_args
from bench.sim.guard import LoopbackOnly
from tests.procs import Proc, RecordingServer, Route, running, scrape, sim_proc, total

SMALL = png(448, 448)
LARGE = png(896, 896)


@pytest.fixture(scope="module")
def origin(canary: RecordingServer) -> Iterator[RecordingServer]:
    png_headers = {"Content-Type": "image/png"}
    routes = {
        "/small.png": Route(body=SMALL, headers=png_headers),
        "/large.png": Route(body=LARGE, headers=png_headers),
        "/again.png": Route(body=SMALL, headers=png_headers),  # same bytes, other URL
        "/text": Route(body=b"not an image"),
        "/redirect": Route(status=302, headers={"Location": canary.url + "/after-redirect"}),
    }
    with RecordingServer(routes) as server:
        yield server


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = sim_proc(tmp_path_factory.mktemp("media"), "--latency", "zero")
    with running(proc):
        yield proc


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Path]]:
    tmp = tmp_path_factory.mktemp("strict")
    media_dir = tmp / "media"
    media_dir.mkdir()
    (media_dir / "ok.png").write_bytes(SMALL)
    proc = sim_proc(
        tmp, "--latency", "zero", "--allowed-media-domains", "example.com",
        "--allowed-local-media-path", str(media_dir),
    )  # fmt: skip
    with running(proc):
        yield proc, media_dir


def ask(
    url: str, part: dict[str, Any], role: str = "user", question: str = "What?"
) -> httpx.Response:
    content = [part, {"type": "text", "text": question}]
    body = {"messages": [{"role": role, "content": content}], "max_tokens": 1}
    return HTTP.post(url + "/v1/chat/completions", json=body, timeout=20)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def mm(url: str) -> tuple[float, float]:
    samples = scrape(url + "/metrics")
    return total(samples, "vllm:mm_cache_queries_total"), total(samples, "vllm:mm_cache_hits_total")


@pytest.mark.slow
def test_loopback_canary_is_fetched(sim: Proc, canary: RecordingServer) -> None:
    # The hole: a default engine fetches any URL, loopback included.
    before = len(canary.hits)
    r = ask(sim.url, image_part(canary.url + "/latest/meta-data"))
    assert len(canary.hits) == before + 1
    assert canary.hits[-1].path == "/latest/meta-data"
    assert r.status_code == 422
    assert r.json()["error"]["code"] == 422


@pytest.mark.slow
def test_redirect_is_followed_to_the_canary(
    sim: Proc, origin: RecordingServer, canary: RecordingServer
) -> None:
    before = len(canary.hits)
    ask(sim.url, image_part(origin.url + "/redirect"))
    assert [h.path for h in canary.hits[before:]] == ["/after-redirect"]


PART_SHAPES: list[tuple[Callable[[str], dict[str, Any]], str]] = [
    (lambda u: {"image_url": u}, "user"),  # untyped, bare string
    (lambda u: {"type": "input_image", "image_url": u}, "user"),
    (lambda u: {"type": "text", "image_url": {"url": u}}, "user"),  # `type` says text
    (lambda u: {"type": "image_url", "image_url": {"url": u}}, "system"),
    (lambda u: {"type": "image_url", "image_url": {"url": u}}, "assistant"),
    (lambda u: {"type": "video_url", "video_url": {"url": u}}, "tool"),
    (lambda u: {"audio_url": {"url": u}}, "user"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "role"), PART_SHAPES)
def test_every_part_shape_and_role_is_fetched(
    sim: Proc, canary: RecordingServer, shape: Callable[[str], dict[str, Any]], role: str
) -> None:
    marker = f"/shape-{len(canary.hits)}"
    before = len(canary.hits)
    ask(sim.url, shape(canary.url + marker), role=role)
    assert [h.path for h in canary.hits[before:]] == [marker]


@pytest.mark.slow
def test_tokenize_fetches_media_too(sim: Proc, canary: RecordingServer) -> None:
    before = len(canary.hits)
    messages = [{"role": "user", "content": [image_part(canary.url + "/via-tokenize")]}]
    r = HTTP.post(sim.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 422
    assert [h.path for h in canary.hits[before:]] == ["/via-tokenize"]


@pytest.mark.slow
def test_image_tokens_and_mm_cache(sim: Proc, origin: RecordingServer) -> None:
    q0, h0 = mm(sim.url)
    small = ask(sim.url, image_part(origin.url + "/small.png")).json()
    large = ask(sim.url, image_part(origin.url + "/large.png")).json()
    # Calibrated to the reference run: about 200 and 790 image tokens (docs/vllm.md).
    assert 195 <= small["usage"]["prompt_tokens"] - 20 <= 215
    assert 780 <= large["usage"]["prompt_tokens"] - 20 <= 800
    assert mm(sim.url) == (q0 + 2, h0)
    # The same bytes from another URL hit the processor cache and the prefix cache.
    again = ask(sim.url, image_part(origin.url + "/again.png")).json()
    assert mm(sim.url) == (q0 + 3, h0 + 1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192


@pytest.mark.slow
def test_other_bytes_miss_the_prefix_cache(sim: Proc) -> None:
    blue = data_url("image/png", png(448, 448, (0, 0, 200)))
    green = data_url("image/png", png(448, 448, (0, 200, 0)))
    first = ask(sim.url, image_part(blue), question="same question").json()
    other = ask(sim.url, image_part(green), question="same question").json()
    same = ask(sim.url, image_part(blue), question="another question").json()
    assert first["usage"]["prompt_tokens"] == other["usage"]["prompt_tokens"]
    # Only the block before the image is shared when the picture differs.
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 16
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192


@pytest.mark.slow
def test_input_audio_is_decoded(sim: Proc) -> None:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(bytes(6400)).decode(),
                                                   "format": "wav"}}  # fmt: skip
    r = ask(sim.url, part)
    assert r.status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize(
    ("url", "status", "fragment"),
    [
        ("{origin}/text", 400, "cannot identify image file"),
        ("data:image/png;base64,@@@", 400, "base64"),
        ("data:image/png,rawbytes", 400, "base64"),
        ("file:///etc/passwd", 400, "--allowed-local-media-path"),
        ("ftp://example.com/x.png", 400, "HTTP, data or file"),
        ("http://127.0.0.1:1/closed.png", 422, "Failed to fetch"),
    ],
)
def test_media_errors(
    sim: Proc, origin: RecordingServer, url: str, status: int, fragment: str
) -> None:
    r = ask(sim.url, image_part(url.replace("{origin}", origin.url)))
    assert r.status_code == status
    assert fragment in r.json()["error"]["message"]


@pytest.mark.slow
def test_allowed_domains_refuse_before_fetching(
    strict: tuple[Proc, Path], canary: RecordingServer
) -> None:
    proc, _ = strict
    before = canary.connections
    r = ask(proc.url, image_part(canary.url + "/refused.png"))
    assert r.status_code == 400
    assert "allowed domains" in r.json()["error"]["message"]
    assert canary.connections == before


@pytest.mark.slow
def test_local_media_path(strict: tuple[Proc, Path]) -> None:
    proc, media_dir = strict
    inside = ask(proc.url, image_part((media_dir / "ok.png").as_uri()))
    assert inside.status_code == 200
    assert inside.json()["usage"]["prompt_tokens"] > 198
    outside = ask(proc.url, image_part((media_dir / ".." / "sim-x.log").as_uri()))
    assert outside.status_code == 400
    assert "subpath" in outside.json()["error"]["message"]


# --- the loopback guard (bench/sim/guard.py) -----------------------------------------------


class RecordingBackend(httpcore.AsyncNetworkBackend):
    """Records where a connection would go and opens none."""

    def __init__(self) -> None:
        self.hosts: list[str] = []

    async def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        self.hosts.append(host)
        raise httpcore.ConnectError("recorded, not connected")

    async def sleep(self, seconds: float) -> None:
        pass


# Numeric hosts only: the verdicts are taken on the resolved addresses and no connection
# is opened (the backend above records instead), so nothing here leaves this machine.
GUARD_TABLE = [
    ("127.0.0.1", "127.0.0.1"),
    ("127.8.9.10", "127.8.9.10"),
    ("::1", "::1"),
    ("::ffff:127.0.0.1", "::ffff:127.0.0.1"),
    ("10.0.0.1", None),
    ("192.0.2.7", None),
    ("169.254.169.254", None),
    ("0.0.0.0", None),
    ("::ffff:10.0.0.1", None),
    ("fe80::1", None),
]


@pytest.mark.parametrize(("host", "connects_to"), GUARD_TABLE)
async def test_guard_connects_to_loopback_only(host: str, connects_to: str | None) -> None:
    inner = RecordingBackend()
    with pytest.raises(httpcore.ConnectError) as err:
        await LoopbackOnly(inner).connect_tcp(host, 80)
    if connects_to is None:
        assert "not a loopback address" in str(err.value)
        assert inner.hosts == []
    else:
        assert inner.hosts == [connects_to]


async def test_guard_checks_every_address_a_name_resolves_to() -> None:
    inner = RecordingBackend()
    with pytest.raises(httpcore.ConnectError):
        await LoopbackOnly(inner).connect_tcp("localhost", 80)
    assert inner.hosts and all(h in ("127.0.0.1", "::1") for h in inner.hosts)


def _chat_about(url: str) -> dict[str, Any]:
    content = [image_part(url), {"type": "text", "text": "What?"}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


@pytest.mark.parametrize("allow_remote", [False, True])
async def test_sim_media_goes_through_the_guard(
    monkeypatch: pytest.MonkeyPatch, canary: RecordingServer, allow_remote: bool
) -> None:
    # Loopback counts as remote here, so the canary shows whether the guard sits on the
    # sim's media path and whether --allow-remote-media is the only way around it.
    monkeypatch.setattr(guard, "is_loopback", lambda address: False)
    app = SimApp(SimConfig(latency="zero", allow_remote_media=allow_remote))
    before = canary.connections
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://sim"
    ) as client:
        r = await client.post("/v1/chat/completions", json=_chat_about(canary.url + "/x.png"))
    await app.client.aclose()
    assert r.status_code == 422
    if allow_remote:
        assert canary.connections == before + 1
    else:
        assert canary.connections == before
        assert "not a loopback address" in r.json()["error"]["message"]


def test_allow_remote_media_is_off_unless_asked() -> None:
    assert parse_args([])[2].allow_remote_media is False
    assert parse_args(["--allow-remote-media"])[2].allow_remote_media is True
