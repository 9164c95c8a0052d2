"""Placements: sticky homes for anchors, even shares, bounded memory."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.routing.placement import Placements

URLS = ["http://a", "http://b", "http://c", "http://d"]


def test_first_choice_while_loads_are_even() -> None:
    p = Placements()
    assert p.home(b"x", URLS) == 0
    p.count(URLS[0], b"x")
    assert p.home(b"y", ["http://b", "http://a"]) == 0


def test_a_new_anchor_skips_an_engine_over_its_share() -> None:
    p = Placements(epsilon=0.2)
    for _ in range(20):
        p.count("http://a")
    # a carries about 18.8 (20 decayed), the mean is 4.7: bound 1.2 x 4.7 + 1 = 6.6.
    assert p.load("http://a") == pytest.approx(sum((1 - 1 / 160) ** k for k in range(20)))
    assert p.home(b"new", URLS) == 1


def test_new_anchors_count_at_once_for_the_load_they_will_bring() -> None:
    """A burst of new conversations: each is charged the mean requests per anchor seen so
    far, before its later turns arrive, so the burst spreads instead of following
    rendezvous alone."""
    p = Placements()
    for i in range(8):  # history: 8 anchors of 4 requests each, evenly spread
        url = URLS[i % 4]
        p.home(bytes([i]), [url])
        for _ in range(4):
            p.count(url, bytes([i]))
    loads = {u: p.load(u) for u in URLS}
    # Their credit is used up: only the decayed requests remain.
    assert max(loads.values()) < 8.0
    homes = Counter(URLS[p.home(f"new{i}".encode(), URLS)] for i in range(8))
    # All prefer a (first in every order, and no request of theirs has come yet), but
    # more requests are expected of each (the mean per anchor, 32 / 8 to 32 / 15, less
    # the first), so they spread.
    assert len(homes) >= 3 and max(homes.values()) <= 3
    for url in URLS:
        assert loads[url] + 1.1 * homes[url] <= p.load(url) <= loads[url] + 3.0 * homes[url]


def test_an_anchors_credit_shrinks_with_its_requests_and_leaves_with_it() -> None:
    p = Placements(capacity=2)
    for i in range(4):  # 2 requests per anchor so far
        p.home(bytes([i]), [URLS[0]])
        p.count(URLS[0], bytes([i]))
        p.count(URLS[0], bytes([i]))
    p.home(b"new", [URLS[1]])
    assert p.load(URLS[1]) == pytest.approx(1.0)  # 8 / 4 requests per anchor, less 1
    p.count(URLS[1], b"new")  # its request arrives: counted once, not twice
    assert p.load(URLS[1]) == pytest.approx(1.0)
    p.home(b"other", [URLS[1]])  # 9 / 5 per anchor: a credit of 0.8
    assert p.load(URLS[1]) == pytest.approx(1.8)
    p.home(b"third", [URLS[2]])
    p.home(b"fourth", [URLS[2]])  # capacity 2: "other" is forgotten, its credit with it
    assert p.load(URLS[1]) == pytest.approx(1.0)


def test_a_placed_anchor_stays_when_loads_change() -> None:
    p = Placements()
    assert p.home(b"x", URLS) == 0
    for _ in range(50):
        p.count("http://a", b"x")
    assert p.home(b"x", URLS) == 0
    # Same engine wherever it sits in the order given.
    assert p.home(b"x", ["http://c", "http://a"]) == 1


def test_an_anchor_whose_engine_left_is_placed_again() -> None:
    p = Placements()
    assert p.home(b"x", URLS) == 0
    assert p.home(b"x", URLS[1:]) == 0
    assert p.home(b"x", URLS) == 1  # now at home on b


def test_memory_is_bounded_least_recent_first() -> None:
    p = Placements(capacity=2)
    p.home(b"x", URLS)
    for _ in range(10):
        p.count("http://a")
    p.home(b"y", ["http://b", "http://a"])
    p.home(b"x", URLS)  # x is now the most recent
    p.home(b"z", ["http://c"])  # evicts y
    assert p.home(b"x", URLS) == 0
    # y was forgotten: placed again by load, a is over its share now.
    assert p.home(b"y", ["http://a", "http://b"]) == 1


def test_old_requests_fade() -> None:
    p = Placements(memory=10)
    for _ in range(10):
        p.count("http://a")
    assert p.home(b"n1", URLS) == 1
    for _ in range(40):
        p.count("http://d")
    assert p.load("http://a") < 0.2
    assert p.home(b"n2", URLS) == 0


def test_loads_stay_exact_across_rescaling() -> None:
    """The decayed counts are kept scaled by a growing unit, rescaled now and then."""
    p = Placements(memory=2)  # the unit doubles per request: rescaled every ~330
    for _ in range(1000):
        p.count("http://a")
    assert p.load("http://a") == pytest.approx(2.0)  # 1 + 1/2 + 1/4 + ...
    assert p.load("http://b") == 0.0
    p.home(b"x", ["http://a", "http://b"])
    for _ in range(400):
        p.count("http://b", b"x")
    assert p.load("http://b") == pytest.approx(2.0)
    assert p.load("http://a") == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    "kwargs", [{"epsilon": -0.1}, {"window": 0}, {"capacity": 0}, {"memory": 1}]
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        Placements(**kwargs)  # type: ignore[arg-type]
