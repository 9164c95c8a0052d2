"""gateway/access/throttle.py through the middleware in-process, as tables of small
cases: when an address is throttled, what its requests get, which keys still go on,
the windows, the units addresses are counted in, the bound on memory and the shared
count. Through real processes (uvicorn, a simulated engine): tests/e2e/test_callers.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.access import throttle as throttle_module
from gateway.access.admission import Admission
from gateway.access.api_keys import KeyRing
from gateway.access.clients import ClientAddresses
from gateway.access.throttle import FailureThrottle, counted_as
from gateway.app import create_app
from gateway.config.key_file import ApiKeyConfig, build_keys
from gateway.config.settings import LimitsSettings, Settings
from gateway.middleware import Front
from gateway.observability.logging import RequestLog
from gateway.observability.metrics import Metrics
from tests.unit.test_middleware import Answer, Inner, call, samples

GOOD = "sk-throttle-good-0123456789"
OTHER = "sk-throttle-other-0123456789"
WRONG = "sk-throttle-wrong-0123456789"
LIMIT = 3
WINDOW = 60.0
# 1000.5 s after the epoch: inside the window [960, 1020), 19.5 s from its end.
NOW = 1000.5


class Logger:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})

    warning = info

    def exception(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


@dataclass
class Shared:
    """An in-memory SharedCount: what other replicas counted, or None (store down)."""

    others: int | None = 0
    calls: list[tuple[str, float]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    async def add(self, client: str, window: float) -> int | None:
        self.calls.append((client, window))
        self.counts[client] = self.counts.get(client, 0) + 1
        if self.others is None:
            return None
        return self.counts[client] + self.others


@dataclass
class Stack:
    app: Any
    inner: Inner
    logger: Logger
    metrics: Metrics
    throttle: FailureThrottle
    keyring: KeyRing
    clock: list[float]


def stack(
    *, shared: Shared | None = None, allow_unauthenticated: bool = False, public: bool = False
) -> Stack:
    inner, logger, metrics = Inner(), Logger(), Metrics()
    keyring = KeyRing(
        build_keys([ApiKeyConfig(key=GOOD, name="good"), ApiKeyConfig(key=OTHER, name="other")]),
        allow_unauthenticated=allow_unauthenticated,
    )
    clock = [NOW]
    throttle = FailureThrottle(
        LIMIT, WINDOW, metrics=metrics, logger=logger, shared=shared, clock=lambda: clock[0]
    )
    context = Front(
        proxy=inner,
        local=inner,
        models=inner,
        metrics=metrics,
        logger=logger,
        request_log=RequestLog(logger, fmt="console", level="info"),
        max_headers=64,
        keyring=keyring,
        admission=Admission(LimitsSettings(), metrics),
        public_metrics=public,
        throttle=throttle,
        clients=ClientAddresses(),
    )
    return Stack(context, inner, logger, metrics, throttle, keyring, clock)


async def send(
    s: Stack, client: str, key: str | None, path: str = "/v1/chat/completions"
) -> Answer:
    headers = [] if key is None else [(b"authorization", b"Bearer " + key.encode())]
    method = "GET" if path in ("/metrics", "/healthz") else "POST"
    return await call(
        s.app,
        {
            "type": "http",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": headers,
            "client": (client, 40000),
        },
    )


def outcomes(answers: list[Answer]) -> list[tuple[int | None, str | None]]:
    return [(a.status, a.code) for a in answers]


UNAUTHORIZED = (401, "invalid_api_key")
THROTTLED = (429, "too_many_failures")


@pytest.mark.parametrize("bad", [WRONG, None, "sk-throttle-another-wrong-0123"])
async def test_failures_past_the_limit_are_throttled(bad: str | None) -> None:
    s = stack()
    answers = [await send(s, "203.0.113.7", bad) for _ in range(LIMIT + 2)]
    assert outcomes(answers) == [UNAUTHORIZED] * LIMIT + [THROTTLED] * 2
    # Retry-After: the seconds to the window's end, rounded up.
    assert answers[-1].headers[b"retry-after"] == b"20"
    assert s.inner.scopes == []
    counts = samples(s.metrics, "gateway_auth_failures_total")
    assert counts == {(("result", "counted"),): LIMIT, (("result", "throttled"),): 2}


async def test_a_throttled_address_learns_nothing_about_keys() -> None:
    """Past the limit a valid key never used from the address gets the wrong key's
    answer, byte for byte: the address cannot tell which of its guesses was right."""
    s = stack()
    for _ in range(LIMIT):
        await send(s, "203.0.113.7", WRONG)
    wrong, valid = await send(s, "203.0.113.7", WRONG), await send(s, "203.0.113.7", GOOD)
    assert outcomes([wrong, valid]) == [THROTTLED] * 2
    assert wrong.body == valid.body and wrong.headers.keys() == valid.headers.keys()
    assert s.inner.scopes == []


async def test_a_key_used_from_the_address_before_still_goes_on() -> None:
    s = stack()
    assert (await send(s, "203.0.113.7", GOOD)).status == 200
    for _ in range(LIMIT + 3):
        await send(s, "203.0.113.7", WRONG)
    assert (await send(s, "203.0.113.7", GOOD)).status == 200
    assert (await send(s, "203.0.113.7", OTHER)).status == 429
    assert len(s.inner.scopes) == 2
    # A key that was known there and is revoked since is a failure like any other.
    s.keyring.replace(build_keys([ApiKeyConfig(key=OTHER, name="other")]))
    assert outcomes([await send(s, "203.0.113.7", GOOD)]) == [THROTTLED]
    assert len(s.inner.scopes) == 2


async def test_other_addresses_are_not_throttled() -> None:
    s = stack()
    for _ in range(LIMIT + 1):
        await send(s, "203.0.113.7", WRONG)
    assert (await send(s, "203.0.113.8", GOOD)).status == 200
    assert outcomes([await send(s, "203.0.113.8", WRONG)]) == [UNAUTHORIZED]
    assert (await send(s, "2001:db8:1:2::5", GOOD)).status == 200


@pytest.mark.parametrize(
    ("first", "second", "together"),
    [
        ("2001:db8:1:2::5", "2001:db8:1:2:ffff::9", True),
        ("2001:db8:1:2::5", "2001:db8:1:3::5", False),
        ("203.0.113.7", "203.0.113.8", False),
        ("203.0.113.7", "::ffff:203.0.113.7", True),
    ],
)
async def test_ipv6_addresses_count_per_64(first: str, second: str, together: bool) -> None:
    s = stack()
    for _ in range(LIMIT):
        await send(s, first, WRONG)
    answer = await send(s, second, WRONG)
    assert (answer.status, answer.code) == (THROTTLED if together else UNAUTHORIZED)


async def test_windows_are_aligned_to_the_epoch() -> None:
    s = stack()
    for _ in range(LIMIT):
        await send(s, "203.0.113.7", WRONG)
    s.clock[0] = 1019.2
    answer = await send(s, "203.0.113.7", WRONG)
    assert (answer.status, answer.headers[b"retry-after"]) == (429, b"1")
    # The next window starts at 1020 whatever the first failure's time: counting restarts.
    s.clock[0] = 1020.0
    answers = [await send(s, "203.0.113.7", WRONG) for _ in range(LIMIT + 1)]
    assert outcomes(answers) == [UNAUTHORIZED] * LIMIT + [THROTTLED]
    assert answers[-1].headers[b"retry-after"] == b"60"


async def test_one_log_line_per_address_and_window_without_the_key() -> None:
    s = stack()
    for _ in range(LIMIT + 5):
        await send(s, "203.0.113.7", WRONG)
    throttled = [line for line in s.logger.lines if line["event"] == "auth_throttled"]
    assert len(throttled) == 1
    (line,) = throttled
    assert line["client"] == "203.0.113.7" and line["retry_after"] == 20
    assert WRONG not in repr(s.logger.lines)
    requests = [line for line in s.logger.lines if line["event"] == "request"]
    assert {line["client"] for line in requests} == {"203.0.113.7"}
    s.clock[0] += WINDOW
    for _ in range(LIMIT + 1):
        await send(s, "203.0.113.7", WRONG)
    assert sum(line["event"] == "auth_throttled" for line in s.logger.lines) == 2


async def test_routes_without_a_key_are_not_throttled() -> None:
    s = stack(public=True)
    for _ in range(LIMIT + 1):
        await send(s, "203.0.113.7", WRONG)
    assert (await send(s, "203.0.113.7", None, "/healthz")).status == 200
    assert (await send(s, "203.0.113.7", WRONG, "/metrics")).status == 200


async def test_no_key_where_none_is_needed_is_no_failure() -> None:
    s = stack(allow_unauthenticated=True)
    for _ in range(LIMIT + 2):
        assert (await send(s, "203.0.113.7", None)).status == 200
    for _ in range(LIMIT):
        await send(s, "203.0.113.7", WRONG)
    # Throttled for keys, but a request without one tries none.
    assert outcomes([await send(s, "203.0.113.7", WRONG)]) == [THROTTLED]
    assert (await send(s, "203.0.113.7", None)).status == 200


async def test_a_request_without_a_client_address_is_not_counted() -> None:
    s = stack()
    for _ in range(LIMIT + 2):
        answer = await call(
            s.app,
            {
                "type": "http",
                "method": "POST",
                "path": "/v1/chat/completions",
                "raw_path": b"/v1/chat/completions",
                "query_string": b"",
                "headers": [],
            },
        )
        assert (answer.status, answer.code) == UNAUTHORIZED


async def test_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle_module, "MAX_TRACKED", 4)
    monkeypatch.setattr(throttle_module, "MAX_KNOWN", 4)
    s = stack()
    for _ in range(LIMIT):
        await send(s, "203.0.113.1", WRONG)
    for n in range(2, 6):
        await send(s, f"203.0.113.{n}", WRONG)
    # Five addresses counted, four kept: the one counted longest ago went, and counts
    # from zero again.
    assert len(s.throttle.counts.windows) == 4
    assert outcomes([await send(s, "203.0.113.1", WRONG)]) == [UNAUTHORIZED]
    for n in range(1, 7):
        await send(s, f"198.51.100.{n}", GOOD)
    assert len(s.throttle._known) == 4


async def test_the_shared_count_throttles_across_replicas() -> None:
    # Other replicas counted the address past the limit already: its first failure here
    # is throttled, and so is everything after it, without asking the store again.
    shared = Shared(others=LIMIT)
    s = stack(shared=shared)
    answers = [await send(s, "2001:db8:1:2::5", WRONG) for _ in range(3)]
    assert outcomes(answers) == [THROTTLED] * 3
    assert shared.calls == [("2001:db8:1:2::/64", WINDOW)]
    assert s.inner.scopes == []


@pytest.mark.parametrize("others", [None, 0])
async def test_without_the_shared_count_the_local_one_holds(others: int | None) -> None:
    shared = Shared(others=others)
    s = stack(shared=shared)
    answers = [await send(s, "203.0.113.7", WRONG) for _ in range(LIMIT + 1)]
    assert outcomes(answers) == [UNAUTHORIZED] * LIMIT + [THROTTLED]
    assert len(shared.calls) == LIMIT


def test_counted_as() -> None:
    assert counted_as("203.0.113.7") == "203.0.113.7"
    assert counted_as("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"


@pytest.mark.parametrize(("failures", "on"), [(0, False), (1, True), (20, True)])
def test_the_setting_turns_it_on(failures: int, on: bool) -> None:
    settings = Settings(api_keys=[GOOD], engines=[], limits=LimitsSettings(auth_failures=failures))
    assert (create_app(settings).throttle is not None) == on


@pytest.mark.parametrize("limits", [{"auth_failures": -1}, {"auth_failure_window": 0}])
def test_bad_limits_are_refused(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LimitsSettings(**limits)
