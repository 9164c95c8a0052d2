"""Every refusal class, and the SSRF probe table, against real engines: refused by the
gateway before anything reaches the engine (its access log and its own counters do not
move) and before any connection to a loopback canary; the same probes sent straight to a
default vLLM are fetched.

The engines run in vLLM's default media configuration (no --allowed-media-domains): the
gateway is what must stop the fetch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from bench.harness.metrics import HTTP
from bench.harness.realvllm.launcher import Engine
from tests.procs import Proc, RecordingServer, Route, wait_for
from tests.real.harness import (
    AUTH,
    POOLING_KEY,
    Snapshot,
    chat_body,
    gateway,
    image_part,
)
from tests.unit.media.test_samples import png

pytestmark = pytest.mark.real_vllm

PNG = png(64, 64)


@dataclass
class Stack:
    chat: Engine
    mm: Engine
    chat_gw: Proc
    mm_gw: Proc
    origin: RecordingServer
    canary: RecordingServer


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    real_chat_engine: Engine,
    real_multimodal_engine: Engine,
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("refusals")
    png_route = Route(body=PNG, headers={"Content-Type": "image/png"})
    with RecordingServer({"/img.png": png_route}) as canary:
        routes = {
            "/img.png": png_route,
            "/redirect": Route(status=302, headers={"Location": canary.url + "/img.png"}),
        }
        with RecordingServer(routes) as origin:
            # Only the origin is allowed; the canary is another port on the same address.
            media = {
                "GATEWAY_MEDIA__ALLOWED_DOMAINS": f'["127.0.0.1:{origin.port}"]',
                "GATEWAY_MEDIA__ALLOWED_SCHEMES": '["http"]',
                "GATEWAY_MEDIA__ALLOWED_NETWORKS": '["127.0.0.0/8"]',
            }
            with (
                gateway(tmp, [real_chat_engine], **media) as chat_gw,
                gateway(tmp, [real_multimodal_engine], **media) as mm_gw,
            ):
                yield Stack(
                    real_chat_engine, real_multimodal_engine, chat_gw, mm_gw, origin, canary
                )


def _chat(s: Stack) -> dict[str, object]:
    return chat_body(s.chat.name, "hello")


# (name, method, path, headers, body, status, code); bodies built per stack.
REFUSALS: list[tuple[str, str, str, dict[str, str], Callable[[Stack], object], int, str]] = [
    ("no key", "POST", "/v1/chat/completions", {}, _chat, 401, "invalid_api_key"),
    ("wrong key", "POST", "/v1/chat/completions",
     {"Authorization": "Bearer sk-not-a-key-0123456789"}, _chat, 401, "invalid_api_key"),
    ("wrong scope", "POST", "/v1/chat/completions",
     {"Authorization": f"Bearer {POOLING_KEY}"}, _chat, 403, "scope_not_allowed"),
    ("blocked: LoRA", "POST", "/v1/load_lora_adapter", AUTH,
     lambda s: {"lora_name": "x", "lora_path": "/tmp"}, 403, "endpoint_blocked"),
    ("blocked: scaling", "POST", "/scale_elastic_ep", AUTH, lambda s: {}, 403,
     "endpoint_blocked"),
    ("blocked: render", "POST", "/v1/chat/completions/render", AUTH, _chat, 403,
     "endpoint_blocked"),
    ("blocked: internal generate", "POST", "/inference/v1/generate", AUTH, lambda s: {}, 403,
     "endpoint_blocked"),
    ("blocked: docs", "GET", "/openapi.json", AUTH, lambda s: None, 403, "endpoint_blocked"),
    ("unknown path", "POST", "/v1/nothing/here", AUTH, _chat, 404, "unknown_endpoint"),
    ("path trick", "POST", "/v1/chat/completions/", AUTH, _chat, 404, "unknown_endpoint"),
    ("unserved model", "POST", "/v1/chat/completions", AUTH,
     lambda s: chat_body("not-served", "hello"), 404, "model_not_found"),
    ("dangerous field: prompt_embeds", "POST", "/v1/completions", AUTH,
     lambda s: {"model": s.chat.name, "prompt": "x", "prompt_embeds": "AAAA"}, 400,
     "field_not_allowed"),
    ("dangerous field: kv_transfer_params", "POST", "/v1/chat/completions", AUTH,
     lambda s: {**_chat(s), "kv_transfer_params": {"remote_host": "127.0.0.1"}}, 400,
     "field_not_allowed"),
    ("dangerous field: chat_template", "POST", "/v1/chat/completions", AUTH,
     lambda s: {**_chat(s), "chat_template": "{{ 7 * 7 }}"}, 400, "field_not_allowed"),
    # Answered `queued` at once by vLLM with its store on, generating on outside the key's
    # in-flight cap; refused unless payload.allow_background.
    ("dangerous field: background", "POST", "/v1/responses", AUTH,
     lambda s: {"model": s.chat.name, "input": "hello", "background": True}, 400,
     "field_not_allowed"),
    ("media URL refused", "POST", "/v1/chat/completions", AUTH,
     lambda s: chat_body(s.chat.name, [image_part(s.canary.url + "/img.png")]), 400,
     "media_url_not_allowed"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status", "code"),
    [r[1:] for r in REFUSALS],
    ids=[r[0] for r in REFUSALS],
)
def test_refused_before_the_engine(
    stack: Stack,
    method: str,
    path: str,
    headers: dict[str, str],
    body: Callable[[Stack], object],
    status: int,
    code: str,
) -> None:
    before, hits = Snapshot.of(stack.chat), stack.canary.connections + len(stack.canary.hits)
    payload = body(stack)
    r = HTTP.request(method, stack.chat_gw.url + path, headers=headers, json=payload, timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert Snapshot.of(stack.chat) == before
    assert stack.canary.connections + len(stack.canary.hits) == hits


def test_an_allowed_request_does_reach_the_engine(stack: Stack) -> None:
    # The control for the table above: the same evidence moves when a request is served.
    before = Snapshot.of(stack.chat)
    r = HTTP.post(stack.chat_gw.url + "/v1/chat/completions", headers=AUTH,
                   json=_chat(stack), timeout=60)  # fmt: skip
    assert r.status_code == 200
    after = Snapshot.of(stack.chat)
    assert after.requests == before.requests + 1
    assert after.finished == before.finished + 1
    assert after.prompt_tokens > before.prompt_tokens


# --- the SSRF table -------------------------------------------------------------------------


def _part_shapes(url: str) -> dict[str, dict[str, object]]:
    return {
        "image_url part": image_part(url),
        # An unknown key on a part is dropped by vLLM, the part fetched as usual.
        # (A part typed "text" that carries an image_url is not fetched by vLLM 0.32.)
        "image_url part with a role key": {**image_part(url), "role": "user"},
        "bare image_url": {"image_url": url},
        "input_image": {"type": "input_image", "image_url": url, "detail": "auto"},
    }


def _probe_urls(s: Stack) -> dict[str, str]:
    port = s.canary.port
    return {
        "loopback": f"http://127.0.0.1:{port}/img.png",
        "localhost": f"http://localhost:{port}/img.png",
        "ipv4-mapped": f"http://[::ffff:127.0.0.1]:{port}/img.png",
        "hex": f"http://0x7f000001:{port}/img.png",
        "upper case": f"http://LOCALHOST:{port}/img.png",
        "userinfo": f"http://localhost@127.0.0.1:{port}/img.png",
        # Allowed origin, redirect to the canary.
        "redirect from the allowed origin": f"{s.origin.url}/redirect",
    }


PROBES = [
    *[("chat", "/v1/chat/completions", shape, "loopback") for shape in
      ("image_url part", "image_url part with a role key", "bare image_url", "input_image")],
    *[("chat", "/v1/chat/completions", "image_url part", where) for where in
      ("localhost", "ipv4-mapped", "hex", "upper case", "userinfo",
       "redirect from the allowed origin")],
    ("tokenize", "/tokenize", "image_url part", "loopback"),
    ("invocations", "/invocations", "image_url part", "loopback"),
    ("system role", "/v1/chat/completions", "image_url part", "loopback"),
]  # fmt: skip
PROBE_IDS = [f"{p[1]} {p[2]} {p[3]}" + (" (system)" if p[0] == "system role" else "")
             for p in PROBES]  # fmt: skip


def _probe_body(s: Stack, kind: str, shape: str, where: str) -> dict[str, object]:
    part = _part_shapes(_probe_urls(s)[where])[shape]
    content = [part, {"type": "text", "text": "What is this?"}]
    role = "system" if kind == "system role" else "user"
    messages = [{"role": role, "content": content}]
    if role == "system":
        messages.append({"role": "user", "content": "hello"})
    return {"model": s.mm.name, "messages": messages, "max_tokens": 2}


def _canary_contacts(s: Stack, send: Callable[[], httpx.Response]) -> tuple[int, httpx.Response]:
    """New connections plus requests the canary saw while `send` ran. Both count: vLLM's
    fetcher keeps its connection to the canary alive between fetches."""
    before = s.canary.connections + len(s.canary.hits)
    r = send()
    # vLLM may still be retrying a fetch when it answers: let the count settle.
    wait_for(lambda: s.canary.connections + len(s.canary.hits) > before, timeout=1)
    return s.canary.connections + len(s.canary.hits) - before, r


@pytest.mark.parametrize(("kind", "path", "shape", "where"), PROBES, ids=PROBE_IDS)
def test_ssrf_probe_direct_is_fetched_through_the_gateway_refused(
    stack: Stack, kind: str, path: str, shape: str, where: str
) -> None:
    body = _probe_body(stack, kind, shape, where)
    # Straight to a default vLLM: the internal URL is fetched.
    direct_hits, direct = _canary_contacts(
        stack, lambda: HTTP.post(stack.mm.url + path, json=body, timeout=60)
    )
    assert direct_hits >= 1, f"vLLM did not fetch it ({direct.status_code} {direct.text})"
    # Through the gateway: refused before any connection, the engine untouched.
    before = Snapshot.of(stack.mm)
    gw_hits, via = _canary_contacts(
        stack,
        lambda: HTTP.post(stack.mm_gw.url + path, headers=AUTH, json=body, timeout=60),
    )
    code = via.json().get("error", {}).get("code") if via.content else None
    print(f"direct {direct.status_code}, {direct_hits} canary contact(s); gateway "
          f"{via.status_code} {code}, {gw_hits} canary contact(s)")  # fmt: skip
    assert 400 <= via.status_code < 500, via.text
    assert gw_hits == 0
    assert Snapshot.of(stack.mm) == before


# --- duplicate JSON keys ----------------------------------------------------------------------
#
# The gateway checks the value its JSON parser keeps for a duplicated key (the last) and
# forwards a body it did not change as sent: it is safe only while the engine keeps the
# same one. The first test proves vLLM does; the second, that the gateway's reading
# matches it end to end.


def _duplicated(model: str, where: str, first: str, last: str) -> bytes:
    """A chat body as JSON text naming image `first`, then `last`, under a key given
    twice at `where` (the part, the image_url object, the message, the messages list)."""
    part = lambda url: json.dumps(image_part(url))  # noqa: E731
    text = '{"type": "text", "text": "What is this?"}'
    if where == "part":
        content = (
            f'[{{"type": "image_url", "image_url": {{"url": "{first}"}}, '
            f'"image_url": {{"url": "{last}"}}}}, {text}]'
        )
        messages = f'[{{"role": "user", "content": {content}}}]'
    elif where == "image_url":
        content = (
            f'[{{"type": "image_url", "image_url": {{"url": "{first}", "url": "{last}"}}}}, {text}]'
        )
        messages = f'[{{"role": "user", "content": {content}}}]'
    elif where == "message":
        messages = (
            f'[{{"role": "user", "content": [{part(first)}, {text}], '
            f'"content": [{part(last)}, {text}]}}]'
        )
    else:
        assert where == "messages"
        messages = (
            f'[{{"role": "user", "content": [{part(first)}, {text}]}}], '
            f'"messages": [{{"role": "user", "content": [{part(last)}, {text}]}}]'
        )
    raw = f'{{"model": "{model}", "max_tokens": 2, "messages": {messages}}}'
    assert json.loads(raw)  # valid JSON; Python keeps the last of each duplicate
    return raw.encode()


DUPLICATED = ("part", "image_url", "message", "messages")
JSON_TYPE = {"Content-Type": "application/json"}


@pytest.mark.parametrize("where", DUPLICATED)
def test_vllm_reads_the_last_of_a_duplicated_key(stack: Stack, where: str) -> None:
    """Straight to vLLM: the canary first, the origin last: only the origin is fetched."""
    body = _duplicated(
        stack.mm.name, where, stack.canary.url + "/img.png", stack.origin.url + "/img.png"
    )
    fetched = len(stack.origin.hits)
    contacts, r = _canary_contacts(
        stack,
        lambda: HTTP.post(
            stack.mm.url + "/v1/chat/completions", content=body, headers=JSON_TYPE, timeout=60
        ),
    )
    assert r.status_code == 200, r.text
    assert len(stack.origin.hits) > fetched
    assert contacts == 0


@pytest.mark.parametrize("where", DUPLICATED)
@pytest.mark.parametrize("canary", ["first", "last"])
def test_the_gateway_checks_the_value_vllm_reads(stack: Stack, where: str, canary: str) -> None:
    """Through the gateway: the canary last is refused before the engine; the canary
    first is never fetched (the gateway and vLLM both read the origin)."""
    evil, good = stack.canary.url + "/img.png", stack.origin.url + "/img.png"
    first, last = (evil, good) if canary == "first" else (good, evil)
    body = _duplicated(stack.mm.name, where, first, last)
    before = Snapshot.of(stack.mm)
    contacts, r = _canary_contacts(
        stack,
        lambda: HTTP.post(
            stack.mm_gw.url + "/v1/chat/completions",
            content=body,
            headers={**AUTH, **JSON_TYPE},
            timeout=60,
        ),
    )
    assert contacts == 0
    if canary == "last":
        assert (r.status_code, r.json()["error"]["code"]) == (400, "media_url_not_allowed")
        assert Snapshot.of(stack.mm) == before
    else:
        assert r.status_code == 200, r.text
        assert Snapshot.of(stack.mm).finished == before.finished + 1


def test_a_duplicated_dangerous_field_is_read_as_vllm_reads_it(stack: Stack) -> None:
    """`chat_template` null first, a template last: vLLM would apply the template, so
    the gateway refuses it."""
    raw = (
        f'{{"model": "{stack.chat.name}", "max_tokens": 2, "chat_template": null, '
        '"messages": [{"role": "user", "content": "hello"}], '
        '"chat_template": "{{ 7 * 7 }}"}'
    )
    before = Snapshot.of(stack.chat)
    r = HTTP.post(stack.chat_gw.url + "/v1/chat/completions", content=raw.encode(),
                  headers={**AUTH, **JSON_TYPE}, timeout=30)  # fmt: skip
    assert (r.status_code, r.json()["error"]["code"]) == (400, "field_not_allowed")
    assert Snapshot.of(stack.chat) == before
