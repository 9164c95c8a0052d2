"""bench/suites/instructions.py's arithmetic: a callgrind dump's count, the count per request."""

from __future__ import annotations

import pytest

from bench.suites.instructions import dump_total, per_request

DUMP = b"""# callgrind format
version: 1
creator: callgrind-3.19.0
events: Ir
summary: 120
fn=(1) main
5 120
totals: 303
"""


def test_a_dump_counts_its_totals_line() -> None:
    assert dump_total(DUMP) == 303


def test_without_totals_the_summary_counts() -> None:
    assert dump_total(DUMP.replace(b"totals: 303\n", b"")) == 120


def test_a_file_with_neither_is_refused() -> None:
    with pytest.raises(ValueError, match="no totals"):
        dump_total(b"# callgrind format\nevents: Ir\n")


def test_the_least_window_per_request_counts() -> None:
    # A window that caught a health check or a trim counts more: the least is taken,
    # per request, whatever the windows' lengths.
    assert per_request([(5_000_000, 10), (4_000_000, 10), (9_000_000, 20)]) == 400_000


@pytest.mark.parametrize("windows", [[], [(100, 0)], [(100, 1), (100, -1)]])
def test_windows_without_requests_are_refused(windows: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError):
        per_request(windows)
