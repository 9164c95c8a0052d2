"""`dns+http://` engine entries (gateway/routing/dns.py) as tables."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config.settings import check_engine
from gateway.routing.dns import DnsEntry
from gateway.routing.pool import EnginePool
from gateway.routing.settings import RoutingSettings
from tests.e2e.test_routing_pool import _upstream


@pytest.mark.parametrize(
    ("spec", "address", "url"),
    [
        ("dns+http://vllm.ns.svc:8000", "10.0.0.7", "http://10.0.0.7:8000"),
        ("dns+http://vllm:8000/", "fd00::7", "http://[fd00::7]:8000"),
        ("dns+https://vllm", "10.0.0.7", "https://10.0.0.7:443"),
        ("dns+http://vllm", "10.0.0.7", "http://10.0.0.7:80"),
        ("dns+http://vllm:8000/prefix/", "10.0.0.7", "http://10.0.0.7:8000/prefix"),
    ],
)
def test_dns_entry_urls(spec: str, address: str, url: str) -> None:
    assert DnsEntry(spec).url(address) == url


@pytest.mark.parametrize(
    "spec",
    [
        "dns+ftp://vllm:8000",
        "dns+http://:8000",
        "dns+http://user:pw@vllm:8000",
        "dns+http://vllm:8000/?x=1",
        "dns+http://vllm:99999",
        "dns+http://vllm:port",
    ],
)
def test_dns_entry_refuses_bad_entries(spec: str) -> None:
    with pytest.raises(ValueError, match="engine entry"):
        DnsEntry(spec)
    with pytest.raises(ValueError, match="engine entry"):
        EnginePool([spec], RoutingSettings(), upstream=_upstream())


@pytest.mark.parametrize(
    "spec",
    ["dns+http://bücher.example:8000", "dns+https://bücher.example", "http://bücher.example"],
)
def test_an_entry_the_settings_accept_never_stops_the_pool(spec: str) -> None:
    """Every engine entry is refused when the settings load, or is one the pool resolves:
    an engine built from a resolved address whose origin cannot be parsed must not abort
    the resolution of every entry (and the lifespan with it)."""
    try:
        check_engine(spec)
    except ValueError:
        return

    async def resolver(host: str, port: int) -> list[str]:
        return ["10.0.0.7"]

    pool = EnginePool(
        [spec, "dns+http://vllm:8000"], RoutingSettings(), upstream=_upstream(), resolver=resolver
    )
    assert asyncio.run(pool.resolve_all())
    assert "http://10.0.0.7:8000" in [e.url for e in pool.engines]
