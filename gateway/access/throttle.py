"""Failed authentication, throttled per client address.

A failure is a request to a route that needs a key, with a wrong key or none. Failures
are counted per client address (gateway/access/clients.py; an IPv6 address by its /64,
which one host can fill) in windows aligned to multiples of the window since the epoch,
so every process and replica counts the same window. Once an address has
`limits.auth_failures` failures in the current window it is throttled until the window
ends: every request of it that needs a key is answered 429 `too_many_failures`, with
Retry-After the seconds to the window's end, and its key is not checked, so the answer
says nothing about the key and guessing gets nowhere: at most `auth_failures` keys per
address and window are ever checked.

One exception keeps valid keys working: a key that has authenticated from that very
address before (remembered per process, the 16,384 most recently used address-and-key
pairs) is still checked and, if it is still valid, goes on. A guesser would have to
present a key that is in use from its own address; a client that shares an address with
a guesser (a NAT, or every client when `trusted_proxies` is missing behind a proxy) and
has not used its key from there before waits until the guessing stops (OWASP's "device
cookie" rule, with the address and the key in place of the cookie).

With a store (`SharedCount`) the count is the larger of the store's, across all
processes and replicas, and this process's own; the store is asked on failures only, and
a process learns that an address is over the limit at its next failure from it: across P
processes at most `limit` + P keys per address and window are checked.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import time
from collections.abc import Callable
from typing import Any

from gateway.access.windows import SharedCount, Window, WindowCounts
from gateway.errors import TooManyFailures
from gateway.observability.metrics import Metrics

# Addresses (IPv6: /64 networks) whose failures are counted at once; past it, the entry
# counted longest ago goes (its window the oldest), so a flood from more addresses than
# this gets at most `auth_failures` checks per address and window, as before.
MAX_TRACKED = 16_384
# Address-and-key pairs remembered as having authenticated (the throttle's exception);
# past it, the least recently used goes.
MAX_KNOWN = 16_384


@functools.lru_cache(maxsize=4096)
def counted_as(client: str) -> str:
    """The unit failures are counted by: an IPv4 address, or an IPv6 address's /64."""
    if ":" not in client:
        return client
    return str(ipaddress.ip_network(client + "/64", strict=False))


class FailureThrottle:
    """Counts failed authentications per client address and throttles past the limit."""

    def __init__(
        self,
        limit: int,
        window: float,
        *,
        metrics: Metrics,
        logger: Any,
        shared: SharedCount | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.counts = WindowCounts(
            limit, window, shared=shared, clock=clock, max_tracked=MAX_TRACKED
        )
        self._log = logger
        self._counts = metrics.auth_failures
        # (client address, key digest) -> None, least recently used first.
        self._known: dict[tuple[str, bytes], None] = {}

    def over(self, client: str) -> bool:
        """Whether `client` is throttled: `limit` failures in the current window."""
        # No window open (no failure counted lately): the usual case, in one test.
        if not self.counts.windows:
            return False
        return self.counts.over(counted_as(client)) is not None

    def known(self, client: str, authorization: bytes | None) -> bool:
        """Whether the key in `authorization` has authenticated from `client` before. The
        same work (one hash, one lookup) whatever the key, so the time it takes says
        nothing about whether the key is valid."""
        if authorization is None:
            return False
        digest = hashlib.sha256(authorization[7:].strip()).digest()
        return (client, digest) in self._known

    def succeeded(self, client: str, digest: bytes) -> None:
        """Remember that the key with `digest` authenticated from `client`."""
        known = self._known
        pair = (client, digest)
        if pair in known:
            del known[pair]
        elif len(known) >= MAX_KNOWN:
            del known[next(iter(known))]
        known[pair] = None

    def refuse(self, client: str) -> TooManyFailures:
        """The answer to a request of a throttled `client` (`over` said so)."""
        unit = counted_as(client)
        return self._refusal(client, unit, self.counts.windows[unit])

    async def failed(self, client: str) -> TooManyFailures | None:
        """Count a failure of `client`: None while it is within the limit (answer 401),
        else the error to answer instead."""
        unit = counted_as(client)
        entry = await self.counts.add(unit, unit)
        if entry.count <= self.counts.limit:
            self._counts.labels("counted").inc()
            return None
        return self._refusal(client, unit, entry)

    def _refusal(self, client: str, unit: str, entry: Window) -> TooManyFailures:
        """429 with the seconds to the window's end; logs `auth_throttled` once per
        address and window (the address, never the key)."""
        self._counts.labels("throttled").inc()
        seconds = self.counts.retry_after(entry)
        if not entry.logged:
            entry.logged = True
            self._log.warning(
                "auth_throttled",
                client=client,
                counted_as=unit,
                failures=entry.count,
                window=self.counts.window,
                retry_after=seconds,
            )
        return TooManyFailures(
            f"Too many failed authentications from this address; retry in {seconds} s.",
            retry_after=seconds,
        )
