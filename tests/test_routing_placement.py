"""Placements: sticky homes for anchors, even shares, bounded memory."""

from __future__ import annotations

import pytest

from gateway.routing.placement import Placements

URLS = ["http://a", "http://b", "http://c", "http://d"]


def test_first_choice_while_shares_are_even() -> None:
    p = Placements(epsilon=0.2)
    assert p.home(b"x", URLS) == 0
    p.count(URLS[0])
    assert p.home(b"y", ["http://b", "http://a"]) == 0


def test_a_new_anchor_skips_an_engine_over_its_share() -> None:
    p = Placements(epsilon=0.2)
    for _ in range(20):
        p.count("http://a")
    # Mean 5, bound 1.2 x 5 + 1 = 7: a (20) is over it, b (0) is not.
    assert p.home(b"new", URLS) == 1


def test_a_placed_anchor_stays_when_shares_change() -> None:
    p = Placements(epsilon=0.2)
    assert p.home(b"x", URLS) == 0
    for _ in range(50):
        p.count("http://a")
    assert p.home(b"x", URLS) == 0
    # Same engine wherever it sits in the order given.
    assert p.home(b"x", ["http://c", "http://a"]) == 1


def test_an_anchor_whose_engine_left_is_placed_again() -> None:
    p = Placements(epsilon=0.2)
    assert p.home(b"x", URLS) == 0
    assert p.home(b"x", URLS[1:]) == 0
    assert p.home(b"x", URLS) == 1  # now at home on b


def test_memory_is_bounded_least_recent_first() -> None:
    p = Placements(epsilon=0.0, capacity=2)
    p.home(b"x", URLS)
    for _ in range(10):
        p.count("http://a")
    p.home(b"y", ["http://b", "http://a"])
    p.home(b"x", URLS)  # x is now the most recent
    p.home(b"z", ["http://c"])  # evicts y
    assert p.home(b"x", URLS) == 0
    # y was forgotten: placed again by shares, a is over its share now.
    assert p.home(b"y", ["http://a", "http://b"]) == 1


def test_shares_decay_with_the_window() -> None:
    p = Placements(epsilon=0.0, window=10)
    for _ in range(10):
        p.count("http://a")
    assert p.home(b"n1", URLS) == 1
    for _ in range(20):  # two generations elsewhere
        p.count("http://d")
    assert p.home(b"n2", URLS) == 0


@pytest.mark.parametrize("kwargs", [{"epsilon": -0.1}, {"window": 0}, {"capacity": 0}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        Placements(**kwargs)  # type: ignore[arg-type]
