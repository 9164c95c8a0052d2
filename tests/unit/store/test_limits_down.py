"""Admission with a store that does not answer (nothing listens at its address), in
process, as a table: each shared limit falls back to the per-process limit or refuses,
as its `*_when_store_down` says, and is counted. With a live store: tests/store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.access.admission import Admission
from gateway.config.key_file import ApiKey, ApiKeyConfig, RateLimit, build_keys
from gateway.config.settings import LimitsSettings
from gateway.errors import GatewayError
from gateway.observability.metrics import Metrics
from gateway.store.client import StoreClient
from gateway.store.limits import SharedLimits
from tests.procs import free_port

PLAIN = "sk-limits-down-0123456789abcdef"
RATE = RateLimit(requests_per_second=0.001, burst=2)

# (limits settings, the key's own limits, requests held at once) -> the outcome of each:
# "ok" or the error code; and the fallbacks counted, (limit, action) -> count.
CASES: list[tuple[dict[str, Any], dict[str, Any], list[str], dict[tuple[str, str], int]]] = [
    # `local`: today's per-process limits.
    ({}, {"rate": RATE}, ["ok", "ok", "rate_limited"], {("rate", "local"): 3}),
    ({}, {"max_in_flight": 2}, ["ok", "ok", "rate_limited"], {("in_flight", "local"): 3}),
    ({"rate_per_key": RATE.model_dump()}, {}, ["ok", "ok", "rate_limited"],
     {("rate", "local"): 3}),
    # `refuse`: 503 for every request of a key with that limit, nothing else checked.
    ({"rate_when_store_down": "refuse"}, {"rate": RATE}, ["limits_unavailable"] * 2,
     {("rate", "refuse"): 2}),
    ({"in_flight_when_store_down": "refuse"}, {"max_in_flight": 5}, ["limits_unavailable"] * 2,
     {("in_flight", "refuse"): 2}),
    # Each limit by its own setting: the cap refuses, so the rate is not reached.
    ({"in_flight_when_store_down": "refuse"}, {"max_in_flight": 5, "rate": RATE},
     ["limits_unavailable"], {("in_flight", "refuse"): 1}),
    # The rate refuses; the cap, local, was counted first.
    ({"rate_when_store_down": "refuse"}, {"max_in_flight": 5, "rate": RATE},
     ["limits_unavailable"], {("in_flight", "local"): 1, ("rate", "refuse"): 1}),
    # A refusing rate setting changes nothing for a key with only a cap.
    ({"rate_when_store_down": "refuse"}, {"max_in_flight": 1}, ["ok", "rate_limited"],
     {("in_flight", "local"): 2}),
]  # fmt: skip


async def outcomes(admission: Admission, key: ApiKey, count: int) -> list[str]:
    """`count` requests of `key` entered one after another, none let go."""
    got = []
    for _ in range(count):
        try:
            await admission.enter_shared(key)
        except GatewayError as exc:
            got.append(exc.code)
            assert exc.headers.get("Retry-After")
        else:
            got.append("ok")
    return got


@pytest.mark.parametrize(("limits", "own", "expected", "fallbacks"), CASES)
def test_shared_limits_without_a_store(
    limits: dict[str, Any],
    own: dict[str, Any],
    expected: list[str],
    fallbacks: dict[tuple[str, str], int],
) -> None:
    async def run() -> tuple[list[str], dict[bytes, int]]:
        client = StoreClient(
            f"redis://127.0.0.1:{free_port()}/0", prefix="t", timeout=0.5, retry=30.0
        )
        try:
            admission = Admission(
                LimitsSettings.model_validate(limits), Metrics(), shared=SharedLimits(client)
            )
            (key,) = build_keys([ApiKeyConfig(key=PLAIN, **own)])
            assert admission.shares(key)
            got = await outcomes(admission, key, len(expected))
            assert not client.up
            assert admission.store_fallbacks == fallbacks
            return got, dict(admission.keys)
        finally:
            await client.aclose()

    got, held = asyncio.run(run())
    assert got == expected
    # Only the admitted requests are counted as held.
    assert sum(held.values()) == expected.count("ok")


@pytest.mark.parametrize(
    ("limits", "own", "shares"),
    [
        ({}, {}, False),
        ({"max_in_flight_per_key": 3}, {}, False),
        ({}, {"max_in_flight": 3}, True),
        ({}, {"rate": RATE}, True),
        ({"rate_per_key": RATE.model_dump()}, {}, True),
    ],
)
def test_only_a_key_with_limits_of_its_own_goes_to_the_store(
    limits: dict[str, Any], own: dict[str, Any], shares: bool
) -> None:
    """The default in-flight cap and the global one stay per process: a key with
    neither a rate nor its own cap is admitted without the store."""
    client = StoreClient("redis://127.0.0.1:1/0", prefix="t", timeout=0.1, retry=1.0)
    admission = Admission(
        LimitsSettings.model_validate(limits), Metrics(), shared=SharedLimits(client)
    )
    (key,) = build_keys([ApiKeyConfig(key=PLAIN, **own)])
    assert admission.shares(key) is shares
    assert not Admission(LimitsSettings.model_validate(limits), Metrics()).shares(key)
