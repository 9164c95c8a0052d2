"""One engine as the pool sees it (`Engine`)."""

from __future__ import annotations

import time
from urllib.parse import urlsplit, urlunsplit

from gateway.routing.engine_load import RecentTokens
from gateway.routing.health import NOT_CHECKED, Verdict
from gateway.routing.model_list import ModelList
from gateway.upstream.origin import Origin


class Engine:
    """One engine. `in_flight` counts requests this process is forwarding to it;
    `running` and `waiting` are the engine's own counts as last scraped (0 when not).
    `origin` is where requests go, parsed from `url` once (ValueError when it is not
    http:// or https:// with a host); `server_name` names an engine whose URL holds a
    resolved address (see Origin).
    `reason` and `detail` say why it is not healthy (None while it is; health.py),
    `since` (time.time()) when that last changed; `public_url` is `url` without any
    user:password@, for logs and answers."""

    __slots__ = (
        "answered_at",
        "backoff",
        "detail",
        "ejected_until",
        "ejections",
        "failing_keys",
        "failures",
        "healthy",
        "in_flight",
        "kv_cache_usage",
        "listing",
        "mine_at_scrape",
        "models_at",
        "origin",
        "public_url",
        "reason",
        "recomputed",
        "running",
        "scraped",
        "sent",
        "since",
        "slow_since",
        "stale",
        "unanswered",
        "url",
        "waiting",
    )

    def __init__(self, url: str, server_name: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.origin = Origin(self.url, server_name)
        self.public_url = public_url(self.url)
        self.healthy = False
        self.reason: str | None = NOT_CHECKED.reason
        self.detail: str | None = NOT_CHECKED.detail
        self.since = time.time()
        # Why the last re-read of a healthy engine's models failed (None: it did not);
        # its last good list stays in use meanwhile.
        self.stale: Verdict | None = None
        self.in_flight = 0
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        # True once `running`, `waiting` and `kv_cache_usage` come from a scrape.
        self.scraped = False
        # Requests this process has sent it, ever.
        self.sent = 0
        # This process's requests that its last scrape may have counted: those in flight
        # when the scrape was sent, plus those sent while it was on its way. An upper
        # bound, so that a request of this process is never taken for another's.
        self.mine_at_scrape = 0
        # The prompt tokens it recomputed lately, from its scraped prefix-cache counters
        # (the shared store places new anchors by them).
        self.recomputed = RecentTokens()
        self.listing = ModelList()
        # When the models were last read; 0: never (the engine cannot be healthy yet).
        self.models_at = 0.0
        # Passive ejection: failed requests in a row (5xx, timeouts), the current
        # back-off, until when.
        self.failures = 0
        # The run's keys (at most routing.eject_keys of them): what lets it eject.
        self.failing_keys: set[str] = set()
        # Whether the run holds a request the engine never answered (a timeout, an
        # answer broken off): a timed-out check then takes it out (checks.py, `_busy`).
        self.unanswered = False
        # When (time.monotonic()) it last answered a request of this process below 500;
        # 0: never.
        self.answered_at = 0.0
        self.backoff = 0.0
        self.ejected_until = 0.0
        self.ejections = 0
        # When this run of timed-out checks began while the engine was busy (None: the
        # last check did not time out, or it was idle).
        self.slow_since: float | None = None

    @property
    def models(self) -> frozenset[str]:
        """The models (and LoRA adapters) the engine listed when last read."""
        return self.listing.ids

    @property
    def load(self) -> int:
        """What the load bound and `least_loaded` compare: the engine's own count of
        requests running and waiting, which every replica and worker reads alike, or
        this process's requests in flight when that is higher (sent since the last
        scrape) or nothing was scraped."""
        if not self.scraped:
            return self.in_flight
        return max(self.in_flight, self.running + self.waiting)

    @property
    def busy(self) -> int:
        """What the shared store's idle-first rule weighs (store.py): this process's
        requests in flight now, plus the other processes' as last scraped (the engine's
        running and waiting then, less this process's requests it may have counted). A
        request of this process that ended since the scrape is not counted, as it is in
        `load` until the next scrape; the load bound keeps `load`, which replicas read
        alike."""
        if not self.scraped:
            return self.in_flight
        return self.in_flight + max(0, self.running + self.waiting - self.mine_at_scrape)

    def __repr__(self) -> str:
        return f"Engine({self.url!r}, healthy={self.healthy}, in_flight={self.in_flight})"


def public_url(url: str) -> str:
    """`url` without the user:password@ part a configured URL may carry."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
