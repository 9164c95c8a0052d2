"""gateway/access/admission.py in-process, as tables: the token bucket, Retry-After, the global
and per-key slots; and the settings that configure them (defaults, per-key overrides
from settings and key files, bad values refused). Through real processes: in
tests/e2e/test_fairness.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.access.admission import Admission, TokenBucket, retry_after
from gateway.config.key_file import (
    ANONYMOUS,
    ApiKey,
    ApiKeyConfig,
    KeyConfigError,
    RateLimit,
    build_keys,
    load_key_file,
)
from gateway.config.settings import LimitsSettings, Settings
from gateway.errors import Overloaded, RateLimited, TooManySequences
from gateway.observability.metrics import Metrics

PLAIN = "sk-admission-0123456789abcdef"
OTHER = "sk-admission-other-0123456789"


# --- the token bucket ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "burst", "times", "expected"),
    [
        # A full bucket: `burst` at once, then the wait for the next token.
        (1.0, 3, [0, 0, 0, 0], [0, 0, 0, 1.0]),
        (2.0, 1, [0, 0, 0.25, 0.5], [0, 0.5, 0.25, 0]),
        # Refilled over time, never above the burst.
        (1.0, 2, [0, 0, 100, 100, 100], [0, 0, 0, 0, 1.0]),
        # Fractions: 10 per second, a burst of 10.
        (10.0, 10, [0] * 10 + [0, 0.05, 0.1], [0] * 10 + [0.1, 0.05, 0]),
        # A refused request takes nothing: waiting the time it was told is enough.
        (0.5, 1, [0, 1, 2], [0, 1.0, 0]),
    ],
)
def test_token_bucket(rate: float, burst: int, times: list[float], expected: list[float]) -> None:
    bucket = TokenBucket(RateLimit(requests_per_second=rate, burst=burst), now=0.0)
    waits = [bucket.take(t) for t in times]
    assert waits == pytest.approx(expected)


@pytest.mark.parametrize(
    ("wait", "seconds"), [(0.001, 1), (0.5, 1), (1.0, 1), (1.01, 2), (2.0, 2), (59.2, 60)]
)
def test_retry_after_rounds_up_to_whole_seconds(wait: float, seconds: int) -> None:
    assert retry_after(wait) == seconds


@pytest.mark.parametrize(
    ("rps", "burst", "capacity"), [(0.2, None, 1), (1, None, 1), (2.5, None, 3), (5, 20, 20)]
)
def test_default_burst_is_one_seconds_worth(rps: float, burst: int | None, capacity: int) -> None:
    assert RateLimit(requests_per_second=rps, burst=burst).capacity == capacity


# --- the slots ------------------------------------------------------------------------


@contextmanager
def key_slot(a: Admission, key: ApiKey) -> Iterator[None]:
    """A request of `key` in flight, as middleware.Front holds one."""
    a.enter_key(key)
    try:
        yield
    finally:
        a.leave_key(key)


def admission(clock: list[float] | None = None, **limits: object) -> Admission:
    now = clock or [0.0]
    return Admission(LimitsSettings.model_validate(limits), Metrics(), clock=lambda: now[0])


def test_global_slot_caps_and_gives_back() -> None:
    a = admission(max_in_flight=2)
    with a.slot(), a.slot():
        assert a.current == 2
        with pytest.raises(Overloaded) as info, a.slot():
            pass
        assert info.value.headers == {"Retry-After": "1"}
        assert a.current == 2
    assert a.current == 0
    with pytest.raises(RuntimeError), a.slot():
        raise RuntimeError("a failed request")
    assert a.current == 0


def test_key_slots_are_per_key_and_held_by_digest() -> None:
    a = admission(max_in_flight_per_key=1)
    key, other = build_keys([PLAIN, OTHER])
    with key_slot(a, key):
        with pytest.raises(RateLimited) as info, key_slot(a, key):
            pass
        assert (info.value.status, info.value.code) == (429, "rate_limited")
        # The same key rebuilt (a key-file reload) is the same key.
        (reloaded,) = build_keys([PLAIN])
        with pytest.raises(RateLimited), key_slot(a, reloaded):
            pass
        with key_slot(a, other), key_slot(a, ANONYMOUS):
            assert len(a.keys) == 3
    assert a.keys == {}


def test_a_refused_request_takes_no_token_and_no_slot() -> None:
    clock = [0.0]
    rate = {"requests_per_second": 1, "burst": 2}
    a = admission(clock, max_in_flight_per_key=1, rate_per_key=rate)
    (key,) = build_keys([PLAIN])
    # Over the in-flight cap: refused before the bucket is asked.
    with key_slot(a, key), pytest.raises(RateLimited), key_slot(a, key):
        pass
    with key_slot(a, key):  # the second token of the burst is still there
        pass
    with pytest.raises(RateLimited) as info, key_slot(a, key):
        pass
    assert info.value.headers == {"Retry-After": "1"}
    clock[0] = 1.0  # a refusal by the bucket took nothing either
    with key_slot(a, key):
        pass
    assert a.keys == {}


def test_a_changed_rate_starts_a_full_bucket() -> None:
    a = admission(rate_per_key={"requests_per_second": 1})
    (key,) = build_keys([PLAIN])
    with key_slot(a, key):
        pass
    with pytest.raises(RateLimited), key_slot(a, key):
        pass
    (faster,) = build_keys([ApiKeyConfig(key=PLAIN, rate=RateLimit(requests_per_second=5))])
    for _ in range(5):
        with key_slot(a, faster):
            pass


# --- engine sequences -------------------------------------------------------------------


def enter(a: Admission, key: ApiKey, weight: int) -> object:
    """A request of `key` whose body asks for `weight` sequences, admitted as
    middleware.Front and the proxy admit it; the caller ends it with `leave`."""
    a.enter_key(key)
    try:
        return asyncio.run(a.charge(key, weight, "n"))
    except BaseException:
        a.leave_key(key)
        raise


def leave(a: Admission, key: ApiKey, charge: object) -> None:
    if charge is not None:
        a.refund(charge)  # type: ignore[arg-type]
    a.leave_key(key)


def test_sequences_count_against_the_keys_cap() -> None:
    a = admission(max_in_flight_per_key=8)
    (key,) = build_keys([PLAIN])
    held = enter(a, key, 6)
    assert a.keys == {key.digest: 6}
    with pytest.raises(RateLimited) as info:
        enter(a, key, 3)
    assert (info.value.code, info.value.headers) == ("rate_limited", {"Retry-After": "1"})
    assert a.keys == {key.digest: 6}  # the refused request took nothing
    two = enter(a, key, 2)
    assert a.keys == {key.digest: 8}
    with pytest.raises(RateLimited):
        a.enter_key(key)
    leave(a, key, two)
    leave(a, key, held)
    assert a.keys == {}


def test_sequences_take_tokens_of_the_keys_rate() -> None:
    clock = [0.0]
    a = admission(clock, rate_per_key={"requests_per_second": 1, "burst": 10})
    (key,) = build_keys([PLAIN])
    for _ in range(2):
        leave(a, key, enter(a, key, 4))
    # 2 tokens left: the third request's first is taken at authentication, then 3 more
    # are missing one; the one taken stays taken (its body was read).
    with pytest.raises(RateLimited) as info:
        enter(a, key, 4)
    assert info.value.headers == {"Retry-After": "2"}
    assert a.keys == {}
    clock[0] = 2.0
    leave(a, key, enter(a, key, 3))


@pytest.mark.parametrize(
    ("limits", "own", "weight", "message"),
    [
        ({}, {}, 257, "the gateway accepts at most 256 in one request"),
        ({"max_sequences_per_request": 8}, {}, 9, "at most 8 in one request"),
        ({"max_in_flight_per_key": 4}, {}, 5, "this API key may run at most 4 at once"),
        ({}, {"max_in_flight": 2}, 3, "this API key may run at most 2 at once"),
        ({}, {"rate": {"requests_per_second": 1, "burst": 6}}, 7, "may run at most 6 at once"),
        ({"rate_per_key": {"requests_per_second": 3}}, {}, 4, "may run at most 3 at once"),
    ],
)
def test_a_request_that_can_never_be_admitted_is_refused_400(
    limits: dict[str, object], own: dict[str, object], weight: int, message: str
) -> None:
    a = admission(**limits)
    (key,) = build_keys([ApiKeyConfig.model_validate({"key": PLAIN, **own})])
    with pytest.raises(TooManySequences) as info:
        enter(a, key, weight)
    error = info.value
    assert (error.status, error.code, error.param) == (400, "too_many_sequences", "n")
    assert message in error.message and f"run {weight} sequences" in error.message
    assert "Retry-After" not in error.headers
    assert a.keys == {}
    # One fewer passes (on a full bucket: the refused request's first token is gone).
    a = admission(**limits)
    leave(a, key, enter(a, key, weight - 1))


# --- settings ---------------------------------------------------------------------------


def test_defaults() -> None:
    limits = LimitsSettings()
    assert (limits.max_in_flight, limits.max_in_flight_per_key) == (1024, 256)
    assert limits.rate_per_key is None


@pytest.mark.parametrize(
    "limits",
    [
        {"max_in_flight_per_key": 0},
        {"max_in_flight_per_key": -3},
        {"rate_per_key": {"requests_per_second": 0}},
        {"rate_per_key": {"requests_per_second": -1, "burst": 2}},
        {"rate_per_key": {"requests_per_second": 1, "burst": 0}},
        {"rate_per_key": {"requests_per_second": "fast"}},
        {"rate_per_key": {"rps": 1}},
    ],
)
def test_bad_limits_are_refused(limits: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(allow_unauthenticated=True, limits=limits)
    assert "limits.max_in_flight_per_key" in str(info.value) or "limits.rate_per_key" in str(
        info.value
    )


def test_limits_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_LIMITS__MAX_IN_FLIGHT_PER_KEY", "7")
    monkeypatch.setenv("GATEWAY_LIMITS__RATE_PER_KEY__REQUESTS_PER_SECOND", "2.5")
    limits = Settings(allow_unauthenticated=True).limits
    assert limits.max_in_flight_per_key == 7
    assert limits.rate_per_key == RateLimit(requests_per_second=2.5)


def test_per_key_overrides_from_settings() -> None:
    entries = [
        {"key": PLAIN, "name": "a", "max_in_flight": 4, "rate": {"requests_per_second": 2}},
        {"key": OTHER, "name": "b"},
    ]
    settings = Settings(api_keys=entries)
    a, b = build_keys(settings.api_keys)
    assert (a.max_in_flight, a.rate) == (4, RateLimit(requests_per_second=2))
    assert (b.max_in_flight, b.rate) == (None, None)


def test_per_key_overrides_from_a_key_file(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(
        f"- key: {PLAIN}\n  name: a\n  max_in_flight: 2\n"
        "  rate: {requests_per_second: 0.5, burst: 3}\n"
        f"- {OTHER}\n"
    )
    a, other = load_key_file(f)
    assert (a.max_in_flight, a.rate) == (2, RateLimit(requests_per_second=0.5, burst=3))
    assert (other.max_in_flight, other.rate) == (None, None)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"max_in_flight": 0}, "entry 1: max_in_flight: Input should be greater than 0"),
        ({"max_in_flight": "many"}, "entry 1: max_in_flight: Input should be a valid integer"),
        ({"rate": {"requests_per_second": 0}}, "entry 1: rate.requests_per_second: Input should"),
        ({"rate": {"requests_per_second": 1, "burst": 0}}, "entry 1: rate.burst: Input should"),
        ({"rate": {"per_second": 1}}, "entry 1: rate.requests_per_second: Field required"),
        ({"rate": 5}, "entry 1: rate: Input should be a valid dictionary"),
    ],
)
def test_bad_per_key_values_in_a_key_file_are_named(
    tmp_path: Path, entry: dict[str, object], message: str
) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(json.dumps([{"key": PLAIN, **entry}]))
    with pytest.raises(KeyConfigError) as info:
        load_key_file(f)
    assert message in str(info.value)
    assert PLAIN not in str(info.value)


@pytest.mark.parametrize(
    "entry",
    [
        {"key": PLAIN, "max_in_flight": 0},
        {"key": PLAIN, "rate": {"requests_per_second": -2}},
        {"key": PLAIN, "rate": {"requests_per_second": 1, "bust": 4}},
    ],
)
def test_bad_per_key_values_in_settings_are_refused(entry: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(api_keys=[entry])
