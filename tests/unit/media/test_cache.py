"""The media cache's bounds: an entry is charged the bytes it holds (a cached image is
its validated bytes and its data: URL, not its URL's length), and entries past their
age are swept, not kept until something looks them up; and with tenants isolated, one
tenant's inline image is a miss for another (a hit answers faster: a timing oracle).

In process: tables of small cases (tests/e2e/test_media_isolation.py serves them)."""

from __future__ import annotations

from typing import Any

from gateway.media.cache import MediaCache
from gateway.media.settings import MediaSettings
from gateway.payload.inspector import PayloadInspector
from gateway.payload.settings import CacheIsolation, PayloadSettings
from tests.unit.media.test_samples import data_url, png
from tests.unit.payload.test_inspector import key as make_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_expired_entries_are_swept_without_being_looked_up() -> None:
    clock = Clock()
    cache: MediaCache[str] = MediaCache(1000, ttl=10, clock=clock)
    cache.put("old", "x", 400)
    clock.now = 5
    cache.put("newer", "y", 400)
    clock.now = 11  # "old" has expired, "newer" has not
    cache.put("late", "z", 100)
    assert len(cache) == 2 and cache.bytes == 500
    assert cache.get("old") is None and cache.get("newer") == "y"
    clock.now = 100
    cache.put("last", "w", 1)
    assert len(cache) == 1 and cache.bytes == 1


def test_a_used_entry_still_expires_in_its_turn() -> None:
    clock = Clock()
    cache: MediaCache[str] = MediaCache(1000, ttl=10, clock=clock)
    cache.put("a", "x", 10)
    clock.now = 5
    cache.put("b", "y", 10)
    clock.now = 9
    assert cache.get("a") == "x"  # most recently used now, but still the oldest
    clock.now = 10.5
    cache.put("c", "z", 10)
    assert cache.get("a") is None and cache.bytes == 20


def chat(url: str) -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": url}}
    return {"model": "m", "messages": [{"role": "user", "content": [part]}]}


async def test_a_cached_image_is_charged_what_it_holds() -> None:
    image = png(256, 256, (9, 99, 199))
    inspector = PayloadInspector(MediaSettings())
    try:
        await inspector.inspect(chat(data_url("image/png", image)), None)
        cache = inspector._inliner._cache
        # Its bytes and its data: URL (a third larger again): far more than the URL's
        # length alone would say for a remote item, and never less than the bytes.
        assert cache.bytes >= len(image) + len(data_url("image/png", image))
    finally:
        await inspector.aclose()


async def test_with_isolation_another_tenants_inline_image_is_a_miss() -> None:
    url = data_url("image/png", png(32, 32, (1, 2, 3)))
    a1, a2 = make_key("a1", tenant="team-a"), make_key("a2", tenant="team-a")
    b1 = make_key("b1", tenant="team-b")
    for mode, entries in ((CacheIsolation.off, 1), (CacheIsolation.tenant, 2),
                          (CacheIsolation.key, 3)):  # fmt: skip
        inspector = PayloadInspector(MediaSettings(), PayloadSettings(cache_isolation=mode))
        try:
            for key in (a1, b1, a2):
                await inspector.inspect(chat(url), key)
            assert len(inspector._inliner._cache) == entries, mode
        finally:
            await inspector.aclose()
