"""The connection limits' rules (gateway/server/limits.py), in process."""

from __future__ import annotations

import pytest

from gateway.config.settings import LimitsSettings, TimeoutSettings
from gateway.server.limits import FD_RESERVE, ConnectionGuard, fit_connections


@pytest.mark.parametrize(
    ("max_connections", "max_in_flight", "fd_limit", "fitted"),
    [
        (4096, 1024, 20_000, 4096),  # fits
        (4096, 1024, 1 << 20, 4096),
        (4096, 1024, 4096, 4096 - 1024 - FD_RESERVE),  # lowered to what remains
        (4096, 1024, 1024, 512),  # nothing remains: half the descriptors
    ],
)
def test_max_connections_fit_the_descriptor_limit(
    max_connections: int, max_in_flight: int, fd_limit: int, fitted: int
) -> None:
    assert fit_connections(max_connections, max_in_flight, fd_limit) == fitted
    limits = LimitsSettings(max_connections=max_connections, max_in_flight=max_in_flight)
    guard = ConnectionGuard(TimeoutSettings(), limits, fd_limit=fd_limit)
    assert guard.max_connections == fitted
