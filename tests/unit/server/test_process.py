"""Process tuning (gateway/server/process.py), in process."""

from __future__ import annotations

from gateway.server.process import malloc_trim


def test_malloc_trim_is_found_on_glibc() -> None:
    trim = malloc_trim()
    assert trim is not None
    trim()
