"""Media and payload security end to end: the gateway under uvicorn, real simulated
engines and loopback canaries.

The simulated engines fetch media exactly as unsafely as a default vLLM (any host,
redirects followed, no private-address blocking), so a check the gateway forgot shows
up here as a canary contact or a request counted by an engine. Every refusal asserts
its status and stable code, that no engine received anything, and that no canary was
contacted.

Processes, started once for the module:
- `gen` (generate runner) and `pool` (pooling runner), both recording requests;
- gateway `inline` (default mode) and `passthrough` (passthrough, with two field
  opt-ins) in front of `gen`; gateway `data_only` in front of `pool`;
- `ref`, a simulator with no gateway, for the reference SSRF table.
In-process: the media `origin` (the only allowed remote host), the `canary` on
127.0.0.1 and `canary6` on ::1 that nothing may ever contact.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.samples import (
    EPS,
    HTML,
    SVG,
    data_url,
    gif,
    jpeg,
    noisy_jpeg,
    png,
    png_header_only,
    wav,
)
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    RecordingServer,
    Route,
    SocketCanary,
    gateway_proc,
    metric,
    sim_proc,
    sim_received,
    wait_for,
)
from tests.unit.media.test_png import PENDING, TWO_HEADERS, png_file, raw_rows
from tests.unit.media.test_samples import av_sample

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
MAX_BODY = 1_000_000
MAX_MEDIA_BYTES = 300_000
MAX_FRAMES = 8
MAX_ITEMS = 4
MAX_UPLOAD = 200_000
UPLOAD_MAX_PARTS = 6

PNG = png(64, 64)
PNG_TWICE = png(96, 96, (10, 200, 10))
PNG_PASS = png(32, 32, (0, 0, 250))


def id3_playlist(segment_url: str) -> bytes:
    """An empty ID3v2 tag, then an HLS playlist: FFmpeg skips the tag when it probes the
    format, finds HLS, and before FFmpeg 7 fetches the segment URL from the engine."""
    return (b"ID3\x04\x00\x00\x00\x00\x00\x00#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n"
            + segment_url.encode() + b"\n#EXT-X-ENDLIST\n")  # fmt: skip


@dataclass
class Stack:
    gen: Proc
    pool: Proc
    ref: Proc
    inline: Proc
    passthrough: Proc
    data_only: Proc
    origin: RecordingServer
    canary: RecordingServer
    canary6: SocketCanary
    # One client for the module: a new httpx client per call costs ~30 ms (SSL context).
    http: httpx.Client

    @property
    def sims(self) -> list[Proc]:
        return [self.gen, self.pool]

    @property
    def o(self) -> str:
        return f"http://127.0.0.1:{self.origin.port}"

    @property
    def c(self) -> str:
        return f"127.0.0.1:{self.canary.port}"

    def untouched(self) -> None:
        assert not self.canary.contacted, self.canary.hits
        assert self.canary6.accepted == 0


def _gateway_env(engine: str, st: dict[str, int], **extra: str) -> dict[str, str]:
    keys = [{"key": KEY_A, "name": "tenant-a"}, {"key": KEY_B, "name": "tenant-b"}]
    return {
        "GATEWAY_ENGINES": json.dumps([engine]),
        "GATEWAY_API_KEYS": json.dumps(keys),
        "GATEWAY_ROUTING__HEALTH_INTERVAL": "30",
        "GATEWAY_LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
        "GATEWAY_LIMITS__MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "GATEWAY_MEDIA__ALLOWED_SCHEMES": json.dumps(["http", "https"]),
        # The origin by IP and port; a name that never resolves here (look-alike tests);
        # ::1 listed as a host, but outside ALLOWED_NETWORKS (the fetch-time check).
        "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps(
            [f"127.0.0.1:{st['origin']}", "images.example.com", f"[::1]:{st['canary6']}"]
        ),
        "GATEWAY_MEDIA__ALLOWED_NETWORKS": json.dumps(["127.0.0.0/8"]),
        "GATEWAY_MEDIA__MAX_BYTES": str(MAX_MEDIA_BYTES),
        "GATEWAY_MEDIA__MAX_FRAMES": str(MAX_FRAMES),
        "GATEWAY_MEDIA__MAX_PIXELS": "4000000",
        "GATEWAY_MEDIA__MAX_ITEMS": str(MAX_ITEMS),
        "GATEWAY_MEDIA__FETCH_TIMEOUT": "3",
        "GATEWAY_MEDIA__UPLOAD_MAX_PARTS": str(UPLOAD_MAX_PARTS),
        # The container checks here, Ogg's included (durations: test_media_duration.py).
        "GATEWAY_MEDIA__ALLOW_UNKNOWN_DURATION": "true",
        **extra,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gateway-media")
    with RecordingServer() as canary:
        canary6 = SocketCanary("::1", family=socket.AF_INET6)
        routes = {
            "/img.png": Route(body=PNG, headers={"Content-Type": "image/png"}),
            "/twice.png": Route(body=PNG_TWICE, headers={"Content-Type": "image/png"}),
            "/pass.png": Route(body=PNG_PASS, headers={"Content-Type": "image/png"}),
            "/eps.png": Route(body=EPS, headers={"Content-Type": "image/png"}),
            "/svg": Route(body=SVG, headers={"Content-Type": "image/svg+xml"}),
            "/bomb.png": Route(body=png_header_only(30_000, 30_000),
                               headers={"Content-Type": "image/png"}),
            "/big.png": Route(body=b"\x89PNG" + b"\0" * MAX_MEDIA_BYTES,
                              headers={"Content-Type": "image/png"}),
            "/octet": Route(body=PNG, headers={"Content-Type": "application/octet-stream"}),
            "/gzip": Route(body=PNG, headers={"Content-Type": "image/png",
                                              "Content-Encoding": "gzip"}),
            "/error": Route(status=500, body=b"boom"),
            "/playlist.mp3": Route(body=id3_playlist(canary.url + "/seg.ts"),
                                   headers={"Content-Type": "audio/mpeg"}),
            "/redirect": Route(status=302, headers={"Location": canary.url + "/stolen.png"}),
            "/moved": Route(status=301, headers={"Location": canary.url + "/stolen.png"}),
            "/temporary": Route(status=307, headers={"Location": canary.url + "/stolen.png"}),
            "/permanent": Route(status=308, headers={"Location": canary.url + "/stolen.png"}),
            "/metadata": Route(
                status=302,
                headers={"Location": "http://169.254.169.254/latest/meta-data/iam/"},
            ),
        }  # fmt: skip
        with RecordingServer(routes) as origin:
            ports = {"origin": origin.port, "canary6": canary6.port}
            gen = sim_proc(tmp, "--record-requests", "400")
            pool = sim_proc(tmp, "--runner", "pooling", "--record-requests", "400")
            ref = sim_proc(tmp, "--record-requests", "50")
            inline = gateway_proc(tmp, _gateway_env(gen.url, ports))
            passthrough = gateway_proc(
                tmp,
                _gateway_env(
                    gen.url,
                    ports,
                    GATEWAY_MEDIA__MODE="passthrough",
                    GATEWAY_MEDIA__ALLOW_KV_TRANSFER_PARAMS="true",
                    GATEWAY_MEDIA__ALLOW_MM_PROCESSOR_KWARGS="true",
                ),
            )
            data_only = gateway_proc(
                tmp, _gateway_env(pool.url, ports, GATEWAY_MEDIA__MODE="data_only")
            )
            sims, gateways = [gen, pool, ref], [inline, passthrough, data_only]
            try:
                # Start in parallel: each start is mostly interpreter import time.
                with ThreadPoolExecutor(3) as ex:
                    list(ex.map(lambda p: p.start("/health"), sims))
                with ThreadPoolExecutor(3) as ex:
                    list(ex.map(lambda p: p.start("/healthz"), gateways))
                for gw in gateways:
                    assert wait_for(lambda gw=gw: HTTP.get(gw.url + "/readyz").status_code == 200)
                with httpx.Client(timeout=15) as http:
                    yield Stack(gen, pool, ref, inline, passthrough, data_only, origin, canary,
                                canary6, http)  # fmt: skip
            finally:
                for proc in [*gateways, *sims]:
                    proc.stop()
                canary6.close()


# --- helpers -----------------------------------------------------------------------------


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def counts(stack: Stack) -> list[float]:
    """Requests each engine received, minus health checks, model discovery and scrapes."""
    return [sim_received(sim.url) for sim in stack.sims]


def records(stack: Stack, sim: Proc, *, scrapes: bool = False) -> list[dict[str, Any]]:
    """What reached `sim`, oldest first; without our own /metrics scrapes and the
    gateways' health checks and model-list reads unless asked (a check every 30 s landed
    inside a test's window now and then, and its empty body failed the test's JSON
    parse; the gateway re-reads /v1/models on a timer too)."""
    got: list[dict[str, Any]] = stack.http.get(sim.url + "/sim/requests").json()
    return [r for r in got if scrapes or r["path"] not in ("/metrics", "/health", "/v1/models")]


def clear(stack: Stack, *sims: Proc) -> None:
    for sim in sims:
        stack.http.delete(sim.url + "/sim/requests")


def origin_hits(stack: Stack, path: str) -> list[dict[str, str]]:
    return [h.headers for h in stack.origin.hits if h.path.split("?")[0] == path]


def refused(
    stack: Stack,
    gateway: Proc,
    path: str,
    body: dict[str, Any],
    status: int,
    code: str,
    detail: str | None = None,
    *,
    engines: bool = True,
) -> dict[str, Any]:
    """POST `body`; assert the refusal, that no engine received anything and that no
    canary was contacted. `detail` is the rule or reason the message must name. A table
    of cases passes `engines=False` and compares the engines' counts around the table."""
    before = counts(stack) if engines else []
    r = stack.http.post(gateway.url + path, json=body, headers=auth())
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code, r.text
    if detail is not None:
        assert f": {detail})" in error["message"], error["message"]
    if engines:
        assert counts(stack) == before
    stack.untouched()
    return dict(error)


def chat(*parts: dict[str, Any], role: str = "user", **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": role, "content": list(parts)}]
    if role != "user":
        messages.append({"role": "user", "content": "describe it"})
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- URL policy: parser differentials, addresses, hosts, schemes -------------------------

# Each entry: (raw URL, rule). ORIGIN is the allowed origin's port, CANARY the canary's.
URLS: list[tuple[str, str]] = [
    # The public vLLM bypasses: one parser checked, another fetched.
    ("http://127.0.0.1:ORIGIN\\@127.0.0.1:CANARY/", "backslash"),  # CVE-2026-24779
    ("http://127.0.0.1:CANARY\\@127.0.0.1:ORIGIN/img.png", "backslash"),  # CVE-2026-25960
    ("http://127.0.0.1:CANARY\\@images.example.com/", "backslash"),
    ("http:\\\\127.0.0.1:CANARY\\img.png", "backslash"),
    # Our own: every other place two parsers could disagree.
    ("http://127.0.0.1:ORIGIN@127.0.0.1:CANARY/img.png", "userinfo"),
    ("http://user:pw@127.0.0.1:ORIGIN/img.png", "userinfo"),
    ("http://127.0.0.1:ORIGIN%40127.0.0.1:CANARY/", "host"),
    ("http://127.0.0.1:CANARY#@127.0.0.1:ORIGIN/img.png", "fragment"),
    ("http://127.0.0.1:CANARY?@127.0.0.1:ORIGIN/img.png", "ip_literal"),
    ("http://127.0.0.1:ORIGIN /img.png", "whitespace"),
    ("http://127.0.0.1:CANARY\t/img.png", "whitespace"),
    ("http://127.0.0.1:CANARY\n/img.png", "whitespace"),
    ("http://127.0.0.1:CANARY\x00.images.example.com/", "whitespace"),
    ("http:/127.0.0.1:CANARY/img.png", "authority"),
    ("http:127.0.0.1:CANARY/img.png", "authority"),
    ("http://127.0.0.1%3aCANARY/img.png", "host"),
    ("http://%31%32%37.0.0.1:CANARY/", "host"),
    ("http://127.0.0.1.:CANARY/img.png", "host"),
    ("http://127.0.0.1:0ORIGIN/img.png", "port"),
    ("http://127.0.0.1:+ORIGIN/img.png", "port"),
    ("http://127.0.0.1:ORIGIN_WRAPPED/img.png", "port"),  # ORIGIN + 65536
    ("http://127.0.0.1:/img.png", "port"),
    ("http://127.0.0.1:ORIGIN/img.png|id", "path"),
    ("http://127.0.0.1:ORIGIN/%zz", "path"),
    ("http://127.0.0.1:ORIGIN/img.png\u202e", "non_ascii"),
    # Loopback in every encoding (IPv4 and IPv6), pointed at the canary's port.
    ("http://127.0.0.1:CANARY/img.png", "ip_literal"),
    ("http://2130706433:CANARY/", "ip_literal"),
    ("http://0x7f000001:CANARY/", "ip_literal"),
    ("http://0x7f.0.0.1:CANARY/", "ip_literal"),
    ("http://0177.0.0.1:CANARY/", "ip_literal"),
    ("http://017700000001:CANARY/", "ip_literal"),
    ("http://127.1:CANARY/", "ip_literal"),
    ("http://127.0.1:CANARY/", "ip_literal"),
    ("http://127.000.000.001:CANARY/", "ip_literal"),
    ("http://0:CANARY/", "ip_literal"),
    ("http://0.0.0.0:CANARY/", "ip_literal"),
    ("http://images.example.127:CANARY/", "ip_literal"),
    ("http://[::1]:CANARY/", "ip_literal"),
    ("http://[0:0:0:0:0:0:0:1]:CANARY/", "ip_literal"),
    ("http://[::]:CANARY/", "ip_literal"),
    ("http://[::ffff:127.0.0.1]:CANARY/", "ip_literal"),
    ("http://[::ffff:7f00:1]:CANARY/", "ip_literal"),
    ("http://[::127.0.0.1]:CANARY/", "ip_literal"),  # IPv4-compatible
    ("http://[64:ff9b::7f00:1]:CANARY/", "ip_literal"),  # NAT64
    ("http://[64:ff9b:1::7f00:1]:CANARY/", "ip_literal"),  # NAT64 local use
    ("http://[2002:7f00:1::]:CANARY/", "ip_literal"),  # 6to4
    ("http://[fe80::1%25lo]:CANARY/", "host"),  # zone id
    ("http://localhost:CANARY/", "domain"),
    # Private and shared ranges.
    ("http://10.0.0.1/", "ip_literal"),
    ("http://172.16.0.1/", "ip_literal"),
    ("http://192.168.1.1/", "ip_literal"),
    ("http://100.64.0.1/", "ip_literal"),
    ("http://[fc00::1]/", "ip_literal"),
    ("http://[fd12:3456::1]/", "ip_literal"),
    # Cloud metadata in every encoding.
    ("http://169.254.169.254/latest/meta-data/", "ip_literal"),
    ("http://2852039166/latest/meta-data/", "ip_literal"),
    ("http://0xa9fea9fe/latest/meta-data/", "ip_literal"),
    ("http://0251.0376.0251.0376/latest/meta-data/", "ip_literal"),
    ("http://169.254.43518/latest/meta-data/", "ip_literal"),
    ("http://[::ffff:169.254.169.254]/latest/meta-data/", "ip_literal"),
    ("http://[::ffff:a9fe:a9fe]/latest/meta-data/", "ip_literal"),
    ("http://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "ip_literal"),
    ("http://[2002:a9fe:a9fe::]/latest/meta-data/", "ip_literal"),
    ("http://[fd00:ec2::254]/latest/meta-data/", "ip_literal"),
    ("http://metadata.google.internal/computeMetadata/v1/", "domain"),
    # Look-alike and IDN hosts of the allowed name.
    ("https://images.example.com.evil.test/a.png", "domain"),
    ("https://evil-images.example.com/a.png", "domain"),
    ("https://images-example.com/a.png", "domain"),
    ("https://images.example.co/a.png", "domain"),
    ("https://sub.images.example.com/a.png", "domain"),
    ("https://images.example.com:8443/a.png", "domain"),
    ("https://images.example.com./a.png", "host"),
    ("https://images.exаmple.com/a.png", "non_ascii"),  # Cyrillic a
    ("https://ｉmages.example.com/a.png", "non_ascii"),  # fullwidth i
    ("https://images.example.com\u200b/a.png", "non_ascii"),  # zero-width space
    ("https://xn--images-ex4c.example.com/a.png", "domain"),
    ("https://images%2eexample.com/a.png", "host"),
    ("https://images..example.com/a.png", "host"),
    # Schemes other than http(s), local files and bare paths.
    ("file:///etc/passwd", "scheme"),
    ("file://localhost/etc/passwd", "scheme"),
    ("FILE:///etc/passwd", "scheme"),
    ("/etc/passwd", "scheme"),
    ("./img.png", "scheme"),
    ("//127.0.0.1:CANARY/img.png", "scheme"),
    ("127.0.0.1:CANARY/img.png", "scheme"),
    ("ftp://127.0.0.1:CANARY/img.png", "scheme"),
    ("gopher://127.0.0.1:CANARY/_GET%20/", "scheme"),
    ("http+unix://%2Fvar%2Frun%2Fdocker.sock/info", "scheme"),
    ("dict://127.0.0.1:CANARY/info", "scheme"),
    ("ws://127.0.0.1:CANARY/", "scheme"),
    ("jar:http://127.0.0.1:CANARY/a.jar!/img.png", "scheme"),
    ("javascript:alert(1)", "scheme"),
    ("C:\\Windows\\win.ini", "backslash"),
    ("", "scheme"),
    # data: URLs that are not base64 or name no type.
    ("data:image/png,%89PNG", "data_url"),
    ("data:;base64,iVBORw0KGgo=", "data_url"),
    ("data:image/png;base64", "data_url"),
]


def fill(stack: Stack, raw: str) -> str:
    wrapped = stack.origin.port + 65536
    return (
        raw.replace("ORIGIN_WRAPPED", str(wrapped))
        .replace("ORIGIN", str(stack.origin.port))
        .replace("CANARY", str(stack.canary.port))
    )


@pytest.mark.slow
def test_url_policy_table(stack: Stack) -> None:
    """Every URL refused before any connection: 400 media_url_not_allowed naming the
    rule, the origin, the canaries and the engine never contacted."""
    origin_before, engines_before = len(stack.origin.hits), counts(stack)
    for raw, rule in URLS:
        url = fill(stack, raw)
        error = refused(stack, stack.inline, "/v1/chat/completions", chat(image(url)), 400,
                        "media_url_not_allowed", rule, engines=False)  # fmt: skip
        # The client's URL is never echoed.
        assert url not in error["message"] or not url
    assert len(stack.origin.hits) == origin_before
    assert counts(stack) == engines_before


# --- where media appears: endpoints, roles and part shapes -------------------------------


def _decision(**media: list[str]) -> dict[str, Any]:
    """A /v1/systemone body: media as top-level URL lists (docs/vllm.md)."""
    question = {
        "type": "noul",
        "instructions": "Is there a cat?",
        "criteria": {"true": "a cat is in the photo", "false": "no cat"},
    }
    return {"model": MODEL, "state": "a photo", "questions": {"q1": question}, **media}


def _shapes(u: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) with the forbidden URL `u` in one media location each."""
    msgs = [{"role": "user", "content": [image(u)]}]
    content = [{"content": [image(u)]}]
    out: list[tuple[str, str, dict[str, Any]]] = [
        (f"chat {role}", "/v1/chat/completions", chat(image(u), role=role))
        for role in ("system", "user", "assistant", "tool", "developer", "narrator")
    ]
    out += [
        ("string image_url", "/v1/chat/completions",
         chat({"type": "image_url", "image_url": u})),
        ("untyped image_url", "/v1/chat/completions", chat({"image_url": {"url": u}})),
        ("text part carrying image_url", "/v1/chat/completions",
         chat({"type": "text", "text": "hi", "image_url": {"url": u}})),
        ("uuid part", "/v1/chat/completions", chat({"uuid": "u1", "image_url": u})),
        ("input_image", "/v1/chat/completions", chat({"type": "input_image", "image_url": u})),
        ("video_url", "/v1/chat/completions",
         chat({"type": "video_url", "video_url": {"url": u}})),
        ("untyped audio_url", "/v1/chat/completions", chat({"audio_url": u})),
        ("unknown part type with image_url", "/v1/chat/completions",
         chat({"type": "weird", "image_url": u})),
        ("content as one object", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": image(u)}]}),
        ("responses input", "/v1/responses",
         {"model": MODEL, "input": [{"role": "user",
                                     "content": [{"type": "input_image", "image_url": u}]}]}),
        ("responses function output", "/v1/responses",
         {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c1",
                                     "output": [{"type": "input_image", "image_url": u}]}]}),
        ("messages url source", "/v1/messages",
         {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
             {"type": "image", "source": {"type": "url", "url": u}}]}]}),
        ("messages tool_result", "/v1/messages",
         {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "t1", "content": [
                 {"type": "image", "source": {"type": "url", "url": u}}]}]}]}),
        ("score queries", "/score", {"model": MODEL, "queries": content, "documents": ["a"]}),
        ("rerank documents", "/v1/rerank",
         {"model": MODEL, "query": "q", "documents": content}),
        ("v2 embed images", "/v2/embed", {"model": MODEL, "images": [u]}),
        ("v2 embed inputs", "/v2/embed", {"model": MODEL, "inputs": content}),
        ("structured decision images", "/v1/systemone", _decision(images=[u])),
        ("structured decision videos", "/v1/systemone", _decision(videos=[u])),
        ("structured decision audio", "/v1/systemone", _decision(audio=[u])),
        ("tokenize", "/tokenize", {"model": MODEL, "messages": msgs}),
        ("invocations", "/invocations", {"model": MODEL, "messages": msgs}),
        ("embeddings messages", "/v1/embeddings", {"model": MODEL, "messages": msgs}),
        ("embeddings input as messages", "/v1/embeddings", {"model": MODEL, "input": msgs}),
        ("pooling", "/pooling", {"model": MODEL, "messages": msgs}),
        ("classify", "/classify", {"model": MODEL, "messages": msgs}),
        ("cohere chat", "/cohere/v2/chat", {"model": MODEL, "messages": msgs}),
        # vLLM's batch chat takes a list of conversations (messages: list[list[...]]).
        ("chat batch", "/v1/chat/completions/batch",
         {"model": MODEL, "messages": [[{"role": "user", "content": "hi"}], msgs]}),
        ("count tokens", "/v1/messages/count_tokens",
         {"model": MODEL, "messages": [{"role": "user", "content": [
             {"type": "image", "source": {"type": "url", "url": u}}]}]}),
    ]  # fmt: skip
    return out + _bypass_shapes(u)


def _bypass_shapes(u: str) -> list[tuple[str, str, dict[str, Any]]]:
    """The ways past the first release's walker (one extra key on a part, an item type
    it did not descend into). vLLM drops unknown keys from parts and fetched these."""
    role_part = {**image(u), "role": "user"}
    msgs = [{"role": "user", "content": [role_part]}]
    return [
        ("part with a role key", "/v1/chat/completions", chat(role_part)),
        ("part with a null role", "/v1/chat/completions", chat({**image(u), "role": None})),
        ("role part in a system message", "/v1/chat/completions", chat(role_part, role="system")),
        ("role part on tokenize", "/tokenize", {"model": MODEL, "messages": msgs}),
        ("role part on invocations", "/invocations", {"model": MODEL, "messages": msgs}),
        ("role part in batch chat", "/v1/chat/completions/batch",
         {"model": MODEL, "messages": [msgs]}),
        ("role part in embeddings", "/v1/embeddings", {"model": MODEL, "messages": msgs}),
        ("role part in pooling", "/pooling", {"model": MODEL, "messages": msgs}),
        ("role part in score content", "/score",
         {"model": MODEL, "queries": [{"content": [role_part]}], "documents": ["a"]}),
        ("role part in cohere chat", "/cohere/v2/chat", {"model": MODEL, "messages": msgs}),
        ("role part in v2 embed", "/v2/embed",
         {"model": MODEL, "inputs": [{"content": [role_part]}]}),
        ("responses item with a role", "/v1/responses",
         {"model": MODEL, "input": [{"role": "user", "type": "input_image", "image_url": u}]}),
        ("responses custom tool output", "/v1/responses",
         {"model": MODEL, "input": [{"type": "custom_tool_call_output", "call_id": "c1",
                                     "output": [{"type": "input_image", "image_url": u}]}]}),
        ("messages block with a role", "/v1/messages",
         {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
             {"type": "image", "role": "user", "source": {"type": "url", "url": u}}]}]}),
        ("messages tool result with a role", "/v1/messages",
         {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
             {"type": "tool_result", "role": "user", "tool_use_id": "t1", "content": [
                 {"type": "image", "source": {"type": "url", "url": u}}]}]}]}),
    ]  # fmt: skip


@pytest.mark.slow
def test_a_default_engine_fetches_what_the_first_walker_missed(stack: Stack) -> None:
    """The simulated engine reads parts as vLLM does (unknown keys dropped): sent to it
    directly, a part with a role key makes it fetch the canary. The table above shows
    the gateway refusing the same bodies before any connection."""
    with RecordingServer() as direct:
        url = f"http://127.0.0.1:{direct.port}/direct.png"
        r = stack.http.post(stack.ref.url + "/v1/chat/completions",
                            json=chat({**image(url), "role": "user"}))  # fmt: skip
        # Fetched: the canary's 418 makes it a fetch error (422), as in vLLM.
        assert r.status_code == 422, r.text
        assert [h.path for h in direct.hits] == ["/direct.png"]
        refused(stack, stack.inline, "/v1/chat/completions", chat({**image(url), "role": "user"}),
                400, "media_url_not_allowed", "ip_literal")  # fmt: skip
        assert len(direct.hits) == 1


@pytest.mark.slow
def test_media_is_found_in_every_endpoint_and_shape(stack: Stack) -> None:
    # A loopback canary URL: if any location were missed, the engine (which fetches like
    # a default vLLM) would contact the canary and count the request.
    shapes = _shapes(f"http://{stack.c}/stolen.png")
    assert len(shapes) > 25
    for label, path, body in shapes:
        try:
            refused(stack, stack.inline, path, body, 400, "media_url_not_allowed", "ip_literal")
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from None


@pytest.mark.slow
def test_duplicate_json_keys_are_read_as_the_engine_reads_them(stack: Stack) -> None:
    """A body with `messages` twice: Python's json (vLLM) keeps the last; so does the
    gateway's parser, so the second, forbidden list is the one checked."""
    safe = json.dumps([{"role": "user", "content": "hi"}])
    evil = json.dumps([{"role": "user", "content": [image(f"http://{stack.c}/dup.png")]}])
    raw = f'{{"model": "{MODEL}", "messages": {safe}, "max_tokens": 2, "messages": {evil}}}'
    assert json.loads(raw)["messages"] == json.loads(evil)
    before = counts(stack)
    r = stack.http.post(stack.inline.url + "/v1/chat/completions", content=raw,
                        headers={**auth(), "Content-Type": "application/json"})  # fmt: skip
    assert (r.status_code, r.json()["error"]["code"]) == (400, "media_url_not_allowed")
    assert counts(stack) == before
    stack.untouched()


# --- what is served: validation of data: URLs and of fetched bytes -----------------------

GIF_OVER = gif(MAX_FRAMES + 1)
FRAME = jpeg(8, 8)

DATA_CASES: list[tuple[str, dict[str, Any], int, str]] = [
    ("svg", image(data_url("image/svg+xml", SVG)), 400, "media_invalid"),
    ("svg labelled png", image(data_url("image/png", SVG)), 400, "media_invalid"),
    ("html", image(data_url("text/html", HTML)), 400, "media_invalid"),
    ("html labelled png", image(data_url("image/png", HTML)), 400, "media_invalid"),
    ("postscript", image(data_url("application/postscript", EPS)), 400, "media_invalid"),
    ("eps labelled png (polyglot)", image(data_url("image/png", EPS)), 400, "media_invalid"),
    ("eps labelled jpeg", image(data_url("image/jpeg", EPS)), 400, "media_invalid"),
    ("png labelled jpeg", image(data_url("image/jpeg", PNG)), 400, "media_invalid"),
    ("octet-stream", image(data_url("application/octet-stream", PNG)), 400, "media_invalid"),
    ("bomb", image(data_url("image/png", png_header_only(30_000, 30_000))), 413,
     "media_too_large"),
    ("truncated jpeg", image(data_url("image/jpeg", noisy_jpeg()[: len(noisy_jpeg()) // 2])),
     400, "media_invalid"),
    ("truncated png", image(data_url("image/png", PNG[:40])), 400, "media_invalid"),
    # PNGs whose rows inflate but which Pillow's decode refuses (gateway/media/png.py).
    ("png row filter 5", image(data_url("image/png", png_file(32, 32, rows=raw_rows(32, 32, 8, 2,
     [0, 5], 1)))), 400, "media_invalid"),
    ("png stream ends before its rows", image(data_url("image/png", png_file(32, 32,
     stream=PENDING))), 400, "media_invalid"),
    ("png palette kept past a second IHDR", image(data_url("image/png", TWO_HEADERS)), 400,
     "media_invalid"),
    ("too many frames", image(data_url("image/gif", GIF_OVER)), 413, "media_too_large"),
    ("over max_bytes", image(data_url("image/png", b"\x89PNG" + b"\0" * MAX_MEDIA_BYTES)),
     413, "media_too_large"),
    ("bad base64", image("data:image/png;base64,iVBOR$w0K"), 400, "media_invalid"),
    ("audio_url with png bytes", {"type": "audio_url", "audio_url": {"url":
     data_url("audio/wav", PNG)}}, 400, "media_invalid"),
    ("audio_url html", {"type": "audio_url", "audio_url": {"url":
     data_url("text/html", HTML)}}, 400, "media_invalid"),
    ("input_audio html as wav", {"type": "input_audio", "input_audio": {"data": b64(HTML),
     "format": "wav"}}, 400, "media_invalid"),
    ("input_audio unknown format", {"type": "input_audio", "input_audio": {"data": b64(wav()),
     "format": "exe"}}, 400, "media_invalid"),
    ("video jpeg frames over cap", {"type": "video_url", "video_url": {"url":
     "data:video/jpeg;base64," + ",".join([b64(FRAME)] * (MAX_FRAMES + 1))}}, 413,
     "media_too_large"),
    ("video jpeg with a png frame", {"type": "video_url", "video_url": {"url":
     f"data:video/jpeg;base64,{b64(FRAME)},{b64(PNG)}"}}, 400, "media_invalid"),
    ("video html as mp4", {"type": "video_url", "video_url": {"url":
     data_url("video/mp4", HTML)}}, 400, "media_invalid"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("label", "part", "status", "code"), DATA_CASES,
                         ids=[c[0] for c in DATA_CASES])  # fmt: skip
def test_data_url_validation(
    stack: Stack, label: str, part: dict[str, Any], status: int, code: str
) -> None:
    refused(stack, stack.inline, "/v1/chat/completions", chat(part), status, code)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "status", "code", "reason"),
    [
        ("/eps.png", 400, "media_invalid", None),  # PostScript served as image/png
        ("/svg", 400, "media_invalid", None),
        ("/octet", 400, "media_invalid", None),
        ("/bomb.png", 413, "media_too_large", None),
        ("/big.png", 422, "media_fetch_failed", "size"),
        ("/gzip", 422, "media_fetch_failed", "content encoding"),
        ("/error", 422, "media_fetch_failed", "status 500"),
        ("/missing", 422, "media_fetch_failed", "status 418"),
        # Redirects are never followed: not to the canary, not to the metadata address.
        ("/redirect", 422, "media_fetch_failed", "redirect"),
        ("/moved", 422, "media_fetch_failed", "redirect"),
        ("/temporary", 422, "media_fetch_failed", "redirect"),
        ("/permanent", 422, "media_fetch_failed", "redirect"),
        ("/metadata", 422, "media_fetch_failed", "redirect"),
    ],
)
def test_fetched_media_is_validated_and_redirects_refused(
    stack: Stack, path: str, status: int, code: str, reason: str | None
) -> None:
    """The allowed loopback origin (ALLOWED_NETWORKS 127.0.0.0/8) answers with bad bytes
    or a redirect: refused; the gateway fetched once, nothing else was contacted."""
    before = len(origin_hits(stack, path))
    refused(stack, stack.inline, "/v1/chat/completions", chat(image(stack.o + path)), status,
            code, reason)  # fmt: skip
    hits = origin_hits(stack, path)
    assert len(hits) == before + 1
    assert hits[-1]["User-Agent"] == "vllm-gateway"
    assert not any(h.path == "/stolen.png" for h in stack.canary.hits)


@pytest.mark.slow
def test_allowed_host_resolving_outside_allowed_networks_is_refused_at_connect(
    stack: Stack,
) -> None:
    """[::1]:port passes the URL policy (it is listed) but ::1 is outside
    ALLOWED_NETWORKS: the transport refuses before connecting."""
    url = f"http://[::1]:{stack.canary6.port}/img.png"
    refused(stack, stack.inline, "/v1/chat/completions", chat(image(url)), 422,
            "media_fetch_failed",
            "address refused: the host resolves to an address that is not public and not "
            "in the gateway's media.allowed_networks")  # fmt: skip


@pytest.mark.slow
def test_every_url_is_checked_before_anything_is_fetched(stack: Stack) -> None:
    """An allowed URL next to a forbidden one: the request is refused and the allowed
    origin is not contacted either (the walk checks every URL before any fetch)."""
    body = chat(image(stack.o + "/img.png?first"), image(f"http://{stack.c}/second.png"))
    before = len(stack.origin.hits)
    refused(stack, stack.inline, "/v1/chat/completions", body, 400, "media_url_not_allowed",
            "ip_literal")  # fmt: skip
    assert len(stack.origin.hits) == before


def _audio_parts(data: bytes, fmt: str, mime: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("input_audio", {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}),
        ("audio_url", {"type": "audio_url", "audio_url": {"url": data_url(mime, data)}}),
    ]  # fmt: skip


@pytest.mark.slow
def test_a_playlist_behind_an_id3_tag_never_reaches_the_engine(stack: Stack) -> None:
    """The ID3 + HLS body whose segment is the canary, as `input_audio` (mp3), as an
    `audio_url` data URL, fetched from the allowed origin as audio/mpeg, and uploaded to
    the transcription route: 400 media_invalid, no engine request, no canary contact."""
    playlist = id3_playlist(stack.canary.url + "/seg.ts")
    for label, part in [*_audio_parts(playlist, "mp3", "audio/mpeg"),
                        ("fetched", {"type": "audio_url", "audio_url": {
                            "url": stack.o + "/playlist.mp3"}})]:  # fmt: skip
        error = refused(stack, stack.inline, "/v1/chat/completions", chat(part), 400,
                        "media_invalid")  # fmt: skip
        assert "not a well-formed file" in error["message"], label
    assert len(origin_hits(stack, "/playlist.mp3")) == 1
    for name, label in [("a.mp3", "audio/mpeg"), ("a.bin", "application/octet-stream")]:
        before = counts(stack)
        r = _upload(stack, {"file": (name, playlist, label)})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "media_invalid"), r.text
        assert counts(stack) == before
        stack.untouched()


@pytest.mark.slow
def test_containers_with_a_playlist_after_the_magic_are_refused(stack: Stack) -> None:
    """The same playlist after each other container's magic bytes."""
    hls = id3_playlist(stack.canary.url + "/seg.ts")[10:]
    cases = [
        *_audio_parts(b"RIFF\x24\x00\x00\x00WAVE" + hls, "wav", "audio/wav"),
        *_audio_parts(b"fLaC" + hls, "flac", "audio/flac"),
        *_audio_parts(b"OggS" + hls, "ogg", "audio/ogg"),
        ("mp4", {"type": "video_url", "video_url": {"url": data_url(
            "video/mp4", b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + hls)}}),
        ("webm", {"type": "video_url", "video_url": {"url": data_url(
            "video/webm", b"\x1a\x45\xdf\xa3" + hls)}}),
    ]  # fmt: skip
    before = counts(stack)
    for label, part in cases:
        error = refused(stack, stack.inline, "/v1/chat/completions", chat(part), 400,
                        "media_invalid", engines=False)  # fmt: skip
        assert "not a well-formed file" in error["message"], label
    assert counts(stack) == before


@pytest.mark.slow
def test_real_audio_reaches_the_engine_unchanged(stack: Stack) -> None:
    """Real MP3, FLAC and Ogg files (FFmpeg's muxers) pass the container checks and reach
    the engine byte for byte, in a chat part and as an upload."""
    for name, fmt, mime in [("tone.mp3", "mp3", "audio/mpeg"), ("tone.flac", "flac",
                             "audio/flac"), ("tone.ogg", "ogg", "audio/ogg")]:  # fmt: skip
        audio = av_sample(name)
        for _label, part in _audio_parts(audio, fmt, mime):
            clear(stack, stack.gen)
            r = stack.http.post(stack.inline.url + "/v1/chat/completions", headers=auth(),
                                json=chat(part))  # fmt: skip
            assert r.status_code == 200, r.text
            (record,) = records(stack, stack.gen)
            assert b64(audio) in record["body"]
    clear(stack, stack.gen)
    audio = av_sample("tone.mp3")
    r = _upload(stack, {"file": ("a.mp3", audio, "application/octet-stream")})
    assert r.status_code == 200, r.text
    assert f"{len(audio)} bytes" in r.json()["text"]
    stack.untouched()


@pytest.mark.slow
def test_size_and_count_caps(stack: Stack) -> None:
    small = image(data_url("image/png", png(4, 4)))
    refused(stack, stack.inline, "/v1/chat/completions", chat(*[small] * (MAX_ITEMS + 1)),
            413, "media_too_large")  # fmt: skip
    big = chat({"type": "text", "text": "x" * MAX_BODY})
    refused(stack, stack.inline, "/v1/chat/completions", big, 413, "request_too_large")


# --- dangerous fields ---------------------------------------------------------------------

EMB = b64(b"\x80\x02ctorch\n")  # the start of a pickle: never deserialised by anyone

FIELD_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("prompt_embeds", "/v1/completions", {"model": MODEL, "prompt": "x", "prompt_embeds": EMB},
     "prompt_embeds"),
    ("prompt_embeds in a prompt object", "/v1/completions",
     {"model": MODEL, "prompt": [{"prompt_embeds": EMB}]}, "prompt[0].prompt_embeds"),
    ("prompt_embeds part", "/v1/chat/completions",
     chat({"type": "prompt_embeds", "prompt_embeds": EMB}),
     "messages[0].content[0].prompt_embeds"),
    ("image_embeds part", "/v1/chat/completions",
     chat({"type": "image_embeds", "image_embeds": EMB}),
     "messages[0].content[0].image_embeds"),
    ("untyped audio_embeds in a tool message", "/v1/chat/completions",
     chat({"audio_embeds": EMB}, role="tool"), "messages[0].content[0].audio_embeds"),
    ("video_embeds in embeddings", "/v1/embeddings",
     {"model": MODEL, "messages": [{"role": "user", "content": [
         {"type": "video_embeds", "video_embeds": EMB}]}]},
     "messages[0].content[0].video_embeds"),
    ("kv_transfer_params", "/v1/chat/completions",
     chat({"type": "text", "text": "hi"}, kv_transfer_params={"do_remote_prefill": True,
          "remote_host": "127.0.0.1", "remote_port": 1}), "kv_transfer_params"),
    ("ec_transfer_params", "/v1/responses",
     {"model": MODEL, "input": "hi", "ec_transfer_params": {"remote_host": "10.0.0.1"}},
     "ec_transfer_params"),
    ("media_io_kwargs", "/v1/chat/completions",
     chat({"type": "text", "text": "hi"}, media_io_kwargs={"video": {"num_frames": -1}}),
     "media_io_kwargs"),
    ("mm_processor_kwargs", "/invocations",
     chat({"type": "text", "text": "hi"}, mm_processor_kwargs={"num_frames": -1}),
     "mm_processor_kwargs"),
    ("chat_template", "/tokenize",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "chat_template": "{{ cycler.__init__.__globals__ }}"}, "chat_template"),
    ("chat_template in kwargs", "/v1/chat/completions",
     chat({"type": "text", "text": "hi"}, chat_template_kwargs={"chat_template": "{{ 1 }}"}),
     "chat_template_kwargs.chat_template"),
    ("mm_processor_kwargs on pooling", "/pooling",
     {"model": MODEL, "input": "x", "mm_processor_kwargs": {"num_frames": -1}},
     "mm_processor_kwargs"),
    # vllm_xargs seeds the engine request's kv/ec transfer params (vLLM 0.32).
    ("kv_transfer_params in vllm_xargs", "/v1/completions",
     {"model": MODEL, "prompt": "x", "vllm_xargs": {"kv_transfer_params": {"x": 1}}},
     "vllm_xargs.kv_transfer_params"),
    ("vllm_xargs not listed by the operator", "/v1/chat/completions",
     chat({"type": "text", "text": "hi"}, vllm_xargs={"anything": 1}), "vllm_xargs.anything"),
    ("pooling plugin data", "/pooling", {"model": MODEL, "data": {"plugin": "input"}}, "data"),
    ("priority", "/v1/chat/completions", chat({"type": "text", "text": "hi"}, priority=-100),
     "priority"),
    ("embeds part nested anywhere", "/v1/responses",
     {"model": MODEL, "input": [{"type": "custom_tool_call_output", "call_id": "c",
                                 "output": [{"role": "user", "image_embeds": EMB}]}]},
     "input[0].output[0].image_embeds"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("label", "path", "body", "param"), FIELD_CASES,
                         ids=[c[0] for c in FIELD_CASES])  # fmt: skip
def test_dangerous_fields_are_refused(
    stack: Stack, label: str, path: str, body: dict[str, Any], param: str
) -> None:
    error = refused(stack, stack.inline, path, body, 400, "field_not_allowed")
    assert error["param"] == param


@pytest.mark.slow
def test_field_opt_in_lets_only_that_field_through(stack: Stack) -> None:
    """The passthrough gateway opts in to kv_transfer_params and mm_processor_kwargs:
    those reach the engine as sent; every other dangerous field is still refused."""
    clear(stack, stack.gen)
    kv = {"do_remote_prefill": False, "remote_engine_id": "e1"}
    for extra in ({"kv_transfer_params": kv}, {"mm_processor_kwargs": {"fps": 1}}):
        body = chat({"type": "text", "text": "hi"}, **extra)
        r = stack.http.post(
            stack.passthrough.url + "/v1/chat/completions", json=body, headers=auth()
        )
        assert r.status_code == 200, r.text
    sent = [json.loads(r["body"]) for r in records(stack, stack.gen)]
    assert sent[0]["kv_transfer_params"] == kv
    assert sent[1]["mm_processor_kwargs"] == {"fps": 1}
    for label, path, body, param in FIELD_CASES:
        if param in ("kv_transfer_params", "mm_processor_kwargs"):
            continue
        error = refused(stack, stack.passthrough, path, body, 400, "field_not_allowed")
        assert error["param"] == param, label


# --- accepted media: what the engine receives --------------------------------------------


def _engine_urls(record: dict[str, Any]) -> list[str]:
    body = json.loads(record["body"])
    return [p["image_url"]["url"] for m in body["messages"] if isinstance(m["content"], list)
            for p in m["content"] if "image_url" in p]  # fmt: skip


def mm_hits(stack: Stack, sim: Proc) -> float:
    return metric(sim.url, "vllm:mm_cache_hits_total")


@pytest.mark.slow
def test_inline_mode_hands_the_engine_a_validated_data_url(stack: Stack) -> None:
    clear(stack, stack.gen)
    url = stack.o + "/img.png"
    r = stack.http.post(stack.inline.url + "/v1/chat/completions", headers=auth(),
                   json=chat(image(url), {"type": "text", "text": "what is this?"}))  # fmt: skip
    assert r.status_code == 200, r.text
    (record,) = records(stack, stack.gen)
    assert _engine_urls(record) == [data_url("image/png", PNG)]
    assert url not in record["body"] and str(stack.origin.port) not in record["body"]
    # Fetched exactly once, by the gateway: the engine made no outbound request.
    hits = origin_hits(stack, "/img.png")
    assert len(hits) == 1 and hits[0]["User-Agent"] == "vllm-gateway"
    assert hits[0]["Accept-Encoding"] == "identity"
    stack.untouched()


@pytest.mark.slow
def test_structured_decisions_reach_the_engine_with_their_images_inlined(
    stack: Stack,
) -> None:
    """/v1/systemone's `images` list is fetched, checked and inlined like a content part,
    and the engine's answer comes back."""
    clear(stack, stack.gen)
    url = stack.o + "/img.png"
    r = stack.http.post(stack.inline.url + "/v1/systemone", headers=auth(),
                        json=_decision(images=[url]))  # fmt: skip
    assert r.status_code == 200, r.text
    assert set(r.json()["answers"]) == {"q1"}
    (record,) = records(stack, stack.gen)
    assert record["path"] == "/v1/systemone"
    assert json.loads(record["body"])["images"] == [data_url("image/png", PNG)]
    assert url not in record["body"] and str(stack.origin.port) not in record["body"]
    stack.untouched()


@pytest.mark.slow
def test_the_same_image_twice_has_the_same_identity(stack: Stack) -> None:
    """By URL twice and once as a data URL: the engine sees the same bytes each time
    and its media cache hits, and the origin is fetched once (the gateway's cache)."""
    clear(stack, stack.gen)
    hits_before = mm_hits(stack, stack.gen)
    url = stack.o + "/twice.png"
    for ref in (url, url, data_url("image/png", PNG_TWICE)):
        r = stack.http.post(stack.inline.url + "/v1/chat/completions", headers=auth(),
                       json=chat(image(ref)))  # fmt: skip
        assert r.status_code == 200, r.text
    seen = [_engine_urls(rec) for rec in records(stack, stack.gen)]
    assert seen == [[data_url("image/png", PNG_TWICE)]] * 3
    assert mm_hits(stack, stack.gen) - hits_before == 2
    assert len(origin_hits(stack, "/twice.png")) == 1


@pytest.mark.slow
def test_passthrough_mode_hands_the_engine_the_canonical_url(stack: Stack) -> None:
    clear(stack, stack.gen)
    raw = f"HTTP://127.0.0.1:{stack.origin.port}/pass.png?size=small"
    canonical = f"http://127.0.0.1:{stack.origin.port}/pass.png?size=small"
    r = stack.http.post(stack.passthrough.url + "/v1/chat/completions", headers=auth(),
                   json=chat(image(raw)))  # fmt: skip
    assert r.status_code == 200, r.text
    (record,) = records(stack, stack.gen)
    assert _engine_urls(record) == [canonical]
    # The gateway did not fetch; the engine did (what passthrough means).
    hits = origin_hits(stack, "/pass.png")
    assert len(hits) == 1 and hits[0]["User-Agent"] != "vllm-gateway"
    # The policy still applies in passthrough, before the engine sees anything.
    bypass = fill(stack, "http://127.0.0.1:CANARY\\@127.0.0.1:ORIGIN/pass.png")
    refused(stack, stack.passthrough, "/v1/chat/completions", chat(image(bypass)), 400,
            "media_url_not_allowed", "backslash")  # fmt: skip
    refused(stack, stack.passthrough, "/v1/chat/completions",
            chat(image(data_url("image/png", EPS))), 400, "media_invalid")  # fmt: skip
    assert len(origin_hits(stack, "/pass.png")) == 1


@pytest.mark.slow
def test_data_only_mode_refuses_remote_urls_and_accepts_data(stack: Stack) -> None:
    before = len(stack.origin.hits)
    msgs = [{"role": "user", "content": [image(stack.o + "/img.png")]}]
    refused(stack, stack.data_only, "/v1/embeddings", {"model": MODEL, "messages": msgs}, 400,
            "media_url_not_allowed", "mode")  # fmt: skip
    assert len(stack.origin.hits) == before
    clear(stack, stack.pool)
    good = data_url("image/png", PNG)
    msgs = [{"role": "user", "content": [image(good), {"type": "text", "text": "a"}]}]
    r = stack.http.post(stack.data_only.url + "/v1/embeddings", headers=auth(),
                   json={"model": MODEL, "messages": msgs})  # fmt: skip
    assert r.status_code == 200, r.text
    (record,) = records(stack, stack.pool)
    assert _engine_urls(record) == [good]


@pytest.mark.slow
def test_client_uuids_are_namespaced_per_key(stack: Stack) -> None:
    clear(stack, stack.gen)
    part = {"type": "image_url", "image_url": {"url": data_url("image/png", PNG)},
            "uuid": "shared-cat"}  # fmt: skip
    for key in (KEY_A, KEY_B, KEY_A):
        r = stack.http.post(stack.inline.url + "/v1/chat/completions", headers=auth(key),
                       json=chat(part))  # fmt: skip
        assert r.status_code == 200, r.text
    uuids = [json.loads(rec["body"])["messages"][0]["content"][0]["uuid"]
             for rec in records(stack, stack.gen)]  # fmt: skip
    a, b, a_again = uuids
    assert a != b and a == a_again
    assert "shared-cat" not in (a, b) and a.startswith("gw-") and b.startswith("gw-")


# --- multipart audio ------------------------------------------------------------------------


def _upload(stack: Stack, files: Any, data: dict[str, Any] | None = None) -> httpx.Response:
    return stack.http.post(stack.inline.url + "/v1/audio/transcriptions", headers=auth(),
                      files=files, data={"model": MODEL, **(data or {})})  # fmt: skip


@pytest.mark.slow
def test_valid_wav_upload_is_forwarded_unchanged(stack: Stack) -> None:
    clear(stack, stack.gen)
    audio = wav(4000)
    r = _upload(stack, {"file": ("a.wav", audio, "audio/wav")})
    assert r.status_code == 200, r.text
    assert f"{len(audio)} bytes" in r.json()["text"]
    (record,) = records(stack, stack.gen)
    assert record["path"] == "/v1/audio/transcriptions"
    sent = (record["body"] or "").encode("latin-1") if record["body"] is not None else (
        base64.b64decode(record["body_base64"]))  # fmt: skip
    assert audio in sent


def _form(boundary: str, fields: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for name, value in fields:
        out += f"--{boundary}\r\n".encode()
        if name == "file":
            out += (b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                    b"Content-Type: audio/wav\r\n\r\n")  # fmt: skip
        else:
            out += f'Content-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        out += value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("label", "params", "fields", "status", "code"),
    [
        # Starlette (vLLM's form parser) decodes part names with the charset: in UTF-7
        # `+AG0-odel` is `model` and `+AHY-llm_xargs` is `vllm_xargs`.
        ("utf-7 charset", "; charset=utf-7",
         [("model", MODEL.encode()), ("+AG0-odel", b"another-model"),
          ("+AHY-llm_xargs", b'{"kv_cache_report_mode": "full"}')], 415,
         "unsupported_media_type"),
        ("utf-16 charset", "; charset=utf-16", [("model", MODEL.encode())], 415,
         "unsupported_media_type"),
        ("another parameter", "; foo=bar", [("model", MODEL.encode())], 415,
         "unsupported_media_type"),
        ("a name outside the field alphabet", "",
         [("model", MODEL.encode()), ("+AG0-odel", b"another-model")], 400, "invalid_request"),
        # Python's str.strip() removed \x1c where Starlette keeps it: two readings of a name.
        ("a control character in a part header", "",
         [("model\x1c", b"another-model")], 400, "invalid_request"),
    ],
)  # fmt: skip
def test_uploads_are_read_as_the_engine_reads_them(
    stack: Stack, label: str, params: str, fields: list[tuple[str, bytes]], status: int, code: str
) -> None:
    boundary = "b0undary"
    body = _form(boundary, [*fields, ("file", wav())])
    before = counts(stack)
    r = stack.http.post(
        stack.inline.url + "/v1/audio/transcriptions", content=body,
        headers={**auth(), "Content-Type": f"multipart/form-data; boundary={boundary}{params}"},
    )  # fmt: skip
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), label
    assert counts(stack) == before
    # The same form in UTF-8 is forwarded, under a Content-Type the gateway wrote.
    clear(stack, stack.gen)
    plain = _form(boundary, [("model", MODEL.encode()), ("file", wav())])
    r = stack.http.post(
        stack.inline.url + "/v1/audio/transcriptions", content=plain,
        headers={**auth(), "Content-Type": f"multipart/form-data; boundary={boundary}"},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    (record,) = records(stack, stack.gen)
    assert record["headers"]["content-type"] == f'multipart/form-data; boundary="{boundary}"'


@pytest.mark.slow
@pytest.mark.parametrize(
    ("label", "files", "data", "status", "code"),
    [
        ("html labelled wav", {"file": ("a.wav", HTML, "audio/wav")}, None, 400,
         "media_invalid"),
        ("png labelled wav", {"file": ("a.wav", PNG, "audio/wav")}, None, 400, "media_invalid"),
        ("png as octet-stream", {"file": ("a.bin", PNG, "application/octet-stream")}, None,
         400, "media_invalid"),
        ("too many parts", {"file": ("a.wav", wav(), "audio/wav")},
         {f"f{i}": "x" for i in range(UPLOAD_MAX_PARTS)}, 400, "invalid_request"),
        ("two files", [("file", ("a.wav", wav(), "audio/wav")),
                       ("file", ("b.wav", wav(), "audio/wav"))], None, 400, "invalid_request"),
        ("forbidden form field", {"file": ("a.wav", wav(), "audio/wav")},
         {"mm_processor_kwargs": "{}"}, 400, "field_not_allowed"),
        ("over the upload cap", {"file": ("a.wav", wav(MAX_UPLOAD), "audio/wav")}, None, 413,
         "request_too_large"),
    ],
)  # fmt: skip
def test_bad_uploads_never_reach_the_engine(
    stack: Stack, label: str, files: Any, data: dict[str, Any] | None, status: int, code: str
) -> None:
    before = counts(stack)
    r = _upload(stack, files, data)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert counts(stack) == before
    stack.untouched()


# --- the reference SSRF table (docs/vllm.md) ----------------------------------------------


def _ssrf_urls(target: Proc) -> list[tuple[str, str]]:
    return [(f"http://127.0.0.1:{target.port}/health", "ip_literal"),
            (f"http://127.0.0.1:{target.port}/metrics", "ip_literal"),
            ("file:///etc/passwd", "scheme")]  # fmt: skip


@pytest.mark.slow
def test_reference_ssrf_table_engine_alone_then_through_the_gateway(stack: Stack) -> None:
    ref = stack.ref
    # The engine alone fetches its own internal routes as "images" (docs/vllm.md:
    # 400 "cannot identify image file" after fetching) and refuses only file:.
    for url, _ in _ssrf_urls(ref):
        clear(stack, ref)
        r = stack.http.post(ref.url + "/v1/chat/completions", json=chat(image(url)))
        path = url.rsplit("/", 1)[-1]
        fetched = [rec for rec in records(stack, ref, scrapes=True) if rec["path"] == "/" + path]
        if url.startswith("file:"):
            assert r.status_code == 400 and "root:" not in r.text
            assert [rec["path"] for rec in records(stack, ref)] == ["/v1/chat/completions"]
        else:
            assert r.status_code == 400 and "cannot identify image file" in r.text
            assert len(fetched) == 1 and fetched[0]["method"] == "GET"
    # Through the gateway: each refused before any connection, the engine untouched.
    for url, rule in _ssrf_urls(ref):
        clear(stack, ref)
        refused(stack, stack.inline, "/v1/chat/completions", chat(image(url)), 400,
                "media_url_not_allowed", rule)  # fmt: skip
        assert records(stack, ref, scrapes=True) == []


@pytest.mark.slow
def test_errors_never_echo_library_text(stack: Stack) -> None:
    """The engine alone leaks Pillow's text with a heap address; the gateway does not."""
    bad = image(data_url("image/png", b"not an image at all"))
    direct = stack.http.post(stack.ref.url + "/v1/chat/completions", json=chat(bad))
    assert direct.status_code == 400 and " at 0x" in direct.text
    error = refused(stack, stack.inline, "/v1/chat/completions", chat(bad), 400,
                    "media_invalid")  # fmt: skip
    assert "0x" not in error["message"] and "PIL" not in error["message"]
