"""Prometheus endpoints scraped into samples, and the one loopback client for short
calls."""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# One client for short calls on loopback: `httpx.get()` builds a client, and with it a
# TLS context, on every call (13 ms here, more on a busy machine), which scrapes taken
# every second kept paying. No keep-alive: the servers come and go between calls.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def scrape(url: str, headers: Mapping[str, str] | None = None, timeout: float = 5.0) -> Samples:
    """Samples of a Prometheus endpoint (the full URL, `.../metrics`) as
    {(name, sorted labels): value}."""
    text = HTTP.get(url, headers=headers, timeout=timeout).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        value
        for (n, ls), value in samples.items()
        if n == name and labels.items() <= dict(ls).items()
    )
