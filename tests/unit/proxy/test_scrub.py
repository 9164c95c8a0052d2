"""The scrub of engine error text (gateway/proxy/scrub.py) as tables, in process.
Through a gateway under uvicorn: tests/e2e/test_engine_errors.py."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway.proxy.scrub import ADDRESS, URL, excerpt, scrub, scrub_json
from tests.e2e.test_upstream import (
    LEAKS,
    LEAKY,
)

SCRUB = [
    # URLs, with the sentence's punctuation kept outside.
    ("fetch http://10.0.0.1:8000/a.png failed", f"fetch {URL} failed"),
    ("see https://example.com/x?y=1#z.", f"see {URL}."),
    ("(url='http://a.b/c')", f"(url='{URL}')"),
    ("got file:///etc/passwd", f"got {URL}"),
    ("bad data:image/png;base64,iVBORw0KGgo=", f"bad {URL}"),
    ("HTTP://UPPER.EXAMPLE/X", URL),
    ("ws://[::1]:9000/socket", URL),
    ("s3://bucket/key and gs://b/k", f"{URL} and {URL}"),
    # host:port, IPv4 and IPv6, with or without a port.
    ("Cannot connect to host engine-0.svc.cluster.local:8000 ssl:default",
     f"Cannot connect to host {ADDRESS} ssl:default"),
    ("connect to localhost:5432", f"connect to {ADDRESS}"),
    ("127.0.0.1:9 refused", f"{ADDRESS} refused"),
    ("[::1]:8000 refused", f"{ADDRESS} refused"),
    ("peer 10.20.30.40 reset", f"peer {ADDRESS} reset"),
    ("resolved to 192.168.0.1.", f"resolved to {ADDRESS}."),
    ("v6 fe80::1 and ::1 and 2001:db8::8a2e:370:7334", f"v6 {ADDRESS} and {ADDRESS} and {ADDRESS}"),
    ("mapped ::ffff:127.0.0.1 here", f"mapped {ADDRESS} here"),
    ("full 2001:0db8:85a3:0000:0000:8a2e:0370:7334", f"full {ADDRESS}"),
    ("Connect call failed ('127.0.0.1', 9)", f"Connect call failed {ADDRESS}"),
    ("Connect call failed ('::1', 9, 0, 0)", f"Connect call failed {ADDRESS}"),
    ("[Errno 111] Connect call failed ('internal', 80)",
     f"[Errno 111] Connect call failed {ADDRESS}"),
    # Memory addresses.
    ("<_io.BytesIO object at 0x7f3c2c1d4a40>", f"<_io.BytesIO object at {ADDRESS}>"),
    ("at 0X7FFF0000ABCD", f"at {ADDRESS}"),
    # Left alone: what error messages legitimately say.
    ("The model `Qwen/Qwen3-VL-2B-Instruct` does not exist.",
     "The model `Qwen/Qwen3-VL-2B-Instruct` does not exist."),
    ("This model's maximum context length is 32768 tokens.",
     "This model's maximum context length is 32768 tokens."),
    ("Expecting value: line 1 column 2 (char 1)", "Expecting value: line 1 column 2 (char 1)"),
    ("max_tokens:5 must be at least 1", "max_tokens:5 must be at least 1"),
    ("at 12:30:45 on 2026-11-30", "at 12:30:45 on 2026-11-30"),
    ("ratio 16:9 and 1:2", "ratio 16:9 and 1:2"),
    ("model llama3:8b", "model llama3:8b"),
    ("version 0.32.0 of vllm", "version 0.32.0 of vllm"),
    ("invalid start byte 0xff", "invalid start byte 0xff"),
    ("metadata: none, std::vector", "metadata: none, std::vector"),
    ("a :: b", "a :: b"),
    # vLLM prints token ids as a list: numbers, not an address in brackets.
    ("token_id(s) [99999999] in logit_bias contain out-of-vocab token ids.",
     "token_id(s) [99999999] in logit_bias contain out-of-vocab token ids."),
    ("ids [1234, 56789] and [12:34]", "ids [1234, 56789] and [12:34]"),
    ("peer [::]:8000 gone", f"peer {ADDRESS} gone"),
    ("", ""),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), SCRUB)
def test_scrub(text: str, expected: str) -> None:
    assert scrub(text) == expected


def test_scrub_removes_every_leak_of_a_real_shaped_message() -> None:
    cleaned = scrub(LEAKY)
    for leak in LEAKS:
        assert leak not in cleaned, leak
    assert "cannot identify image file" in cleaned and "Cannot connect to host" in cleaned


def test_scrub_is_linear_on_hostile_text() -> None:
    # Long runs that almost match: a quadratic pattern would take minutes here.
    hostile = ("a" * 60_000, "a." * 30_000 + ":", "1." * 30_000, ":" * 60_000, "0x" * 30_000,
               "a-" * 30_000 + ":1", "ab:" * 20_000)  # fmt: skip
    for text in hostile:
        assert len(scrub(text)) >= 1


def test_scrub_json_keeps_the_shape_and_scrubs_every_string() -> None:
    body = {
        "error": {"message": LEAKY, "type": "BadRequestError", "param": "url", "code": 400},
        "detail": [{"msg": "at 10.0.0.1:80", "n": 3, "ok": True, "none": None}],
        "http://k.example/": "key too",
    }
    out = orjson.loads(scrub_json(json.dumps(body).encode()) or b"")
    assert out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
    assert out["error"]["param"] == "url"
    assert out["detail"] == [{"msg": f"at {ADDRESS}", "n": 3, "ok": True, "none": None}]
    assert URL in out
    assert not any(leak in json.dumps(out) for leak in LEAKS)
    assert scrub_json(b"<html>not json</html>") is None
    deep: Any = "http://x.example/"
    for _ in range(100):
        deep = [deep]
    assert "x.example" not in (scrub_json(json.dumps(deep).encode()) or b"").decode()


def test_excerpt_is_bounded() -> None:
    assert excerpt(b"x" * 5000).endswith("...") and len(excerpt(b"x" * 5000)) == 1003
    assert excerpt(None).startswith("(not read")
    assert excerpt(b"\xff\xfe ok") == "\ufffd\ufffd ok"
