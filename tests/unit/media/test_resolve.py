"""Cached verdicts of inline images: keyed so that one is never reused for other bytes,
another declared type or other settings; and a body whose images are already in their
canonical form is forwarded as sent (no re-serialisation).

In process: tables of small cases (the loopback tests in tests/e2e/test_media.py cover
the served path)."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import AsyncIterator
from typing import Any

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from gateway.errors import MediaInvalid, MediaTooLarge
from gateway.media.resolve import fingerprint
from gateway.media.settings import MediaSettings
from gateway.payload.inspector import PayloadInspector
from tests.unit.media.test_samples import data_url, media_digest, png
from tests.unit.payload.digests import digests

PNG = png(16, 16)
PNG_URL = data_url("image/png", PNG)


def chat(*urls: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


def url_of(body: dict[str, Any], index: int = 0) -> str:
    url: str = body["messages"][0]["content"][index]["image_url"]["url"]
    return url


@pytest.fixture
async def inspector() -> AsyncIterator[PayloadInspector]:
    inspector = PayloadInspector(MediaSettings())
    yield inspector
    await inspector.aclose()


async def test_a_cached_verdict_is_not_reused_for_other_bytes(inspector: PayloadInspector) -> None:
    cache = inspector._inliner._cache
    await inspector.inspect(chat(PNG_URL), None)
    assert len(cache) == 1
    # The same image with its signature broken: all but the first characters of its
    # base64 text are the cached one's, but the text differs, so it is decoded and
    # validated, and refused.
    broken = data_url("image/png", b"\x00" + PNG[1:])
    assert broken[40:] == PNG_URL[40:]
    with pytest.raises(MediaInvalid):
        await inspector.inspect(chat(broken), None)
    # Another, valid, image: a new entry of its own, with its own digest.
    other = png(16, 16, (1, 2, 3))
    inspection = await inspector.inspect(chat(data_url("image/png", other)), None)
    assert digests(inspection) == [media_digest(other)]
    assert len(cache) == 2


async def test_the_same_bytes_in_another_base64_text_are_checked_again(
    inspector: PayloadInspector,
) -> None:
    """Non-zero unused bits in the last group decode to the same bytes: a different
    text, a different key; the bytes are validated (and forwarded canonical)."""
    cache = inspector._inliner._cache
    text = base64.b64encode(PNG).decode()
    assert text.endswith("=")  # a short last group, with bits to spare
    last = text.rstrip("=")[-1]
    variant = text.rstrip("=")[:-1] + chr(ord(last) + 1) + "=" * (len(text) - len(text.rstrip("=")))
    assert base64.b64decode(variant, validate=True) == PNG
    await inspector.inspect(chat(PNG_URL), None)
    body = chat("data:image/png;base64," + variant)
    inspection = await inspector.inspect(body, None)
    assert len(cache) == 2
    assert inspection.changed and url_of(body) == PNG_URL
    # Routed as the same image: the digest is the canonical text's, not the variant's.
    assert digests(inspection) == [media_digest(PNG)]


async def test_a_cached_verdict_is_not_reused_under_other_settings() -> None:
    """Two inspectors sharing one cache (as a settings reload might): the one with the
    lower pixel cap refuses the image the other one cached as good."""
    lenient = PayloadInspector(MediaSettings())
    strict = PayloadInspector(MediaSettings(max_pixels=15 * 15))
    strict._inliner._cache = lenient._inliner._cache
    try:
        await lenient.inspect(chat(PNG_URL), None)
        with pytest.raises(MediaTooLarge):
            await strict.inspect(chat(PNG_URL), None)
    finally:
        await lenient.aclose()
        await strict.aclose()


@pytest.mark.parametrize(
    "change",
    [
        {"validation": "header"},
        {"validation": "reencode"},
        {"max_bytes": 1000},
        {"max_pixels": 100},
        {"min_dimension": 20},
        {"max_frames": 1},
        {"image_formats": ["PNG"]},
        {"audio_formats": ["wav"]},
        {"video_formats": ["mp4"]},
    ],
)
def test_every_setting_that_decides_a_verdict_changes_the_key(change: dict[str, Any]) -> None:
    assert fingerprint(MediaSettings.model_validate(change)) != fingerprint(MediaSettings())
    assert fingerprint(MediaSettings()) == fingerprint(MediaSettings())


async def test_a_canonical_body_is_forwarded_as_sent(inspector: PayloadInspector) -> None:
    for _ in range(2):  # validated, then served from the cache
        body = chat(PNG_URL)
        sent = url_of(body)
        inspection = await inspector.inspect(body, None)
        assert not inspection.changed
        assert url_of(body) is sent
        assert (
            digests(inspection)
            == [media_digest(PNG)]
            == [hashlib.sha256(sent[22:].encode()).hexdigest()]
        )


@pytest.mark.parametrize(
    "url",
    [
        "data:IMAGE/PNG;base64," + PNG_URL.partition(",")[2],
        "data:image/png;charset=utf-8;base64," + PNG_URL.partition(",")[2],
    ],
)
async def test_a_data_url_in_another_form_is_rewritten(
    inspector: PayloadInspector, url: str
) -> None:
    for _ in range(2):
        body = chat(url)
        inspection = await inspector.inspect(body, None)
        assert inspection.changed and url_of(body) == PNG_URL
        assert digests(inspection) == [media_digest(PNG)]


async def test_a_reencoded_image_is_rewritten_with_the_new_bytes() -> None:
    info = PngInfo()
    info.add_text("Comment", "dropped by re-encoding")
    out = io.BytesIO()
    Image.open(io.BytesIO(PNG)).save(out, format="PNG", pnginfo=info)
    tagged = out.getvalue()
    inspector = PayloadInspector(MediaSettings(validation="reencode"))
    try:
        for _ in range(2):
            body = chat(data_url("image/png", tagged))
            assert (await inspector.inspect(body, None)).changed
            assert url_of(body) == PNG_URL  # the comment dropped
    finally:
        await inspector.aclose()


async def test_one_rewritten_item_rewrites_the_body(inspector: PayloadInspector) -> None:
    body = chat(PNG_URL, "data:IMAGE/PNG;base64," + PNG_URL.partition(",")[2])
    assert (await inspector.inspect(body, None)).changed
    assert url_of(body, 0) == url_of(body, 1) == PNG_URL
