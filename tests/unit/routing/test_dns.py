"""`dns+http://` engine entries (gateway/routing/dns.py) as tables."""

from __future__ import annotations

import pytest

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
