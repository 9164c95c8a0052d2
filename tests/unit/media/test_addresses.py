"""Address classification: which answers the fetcher may connect to.

Python 3.11's `ipaddress` gets several of these wrong (`is_global` is True for
`::127.0.0.1`, NAT64, 6to4 and site-local addresses, and `100.64.0.1` is neither global
nor private); each row pins the gateway's verdict, not the standard library's."""

from __future__ import annotations

import ipaddress

import pytest

from gateway.media.addresses import AddressPolicy, is_public

REFUSED = [
    "0.0.0.0", "0.1.2.3", "10.0.0.1", "10.255.255.255", "100.64.0.1", "100.127.255.254",
    "127.0.0.1", "127.255.255.254", "169.254.169.254", "169.254.0.1", "172.16.0.1",
    "172.31.255.255", "192.0.0.1", "192.0.0.9", "192.0.2.1", "192.88.99.1", "192.168.0.1",
    "198.18.0.1", "198.19.255.255", "198.51.100.7", "203.0.113.9", "224.0.0.1",
    "239.255.255.250", "240.0.0.1", "255.255.255.255",
    "::", "::1", "::ffff:127.0.0.1", "::ffff:8.8.8.8", "::ffff:169.254.169.254",
    "::127.0.0.1", "::8.8.8.8", "64:ff9b::7f00:1", "64:ff9b::808:808", "64:ff9b:1::a9fe:a9fe",
    "2002:7f00:1::", "2002:808:808::1", "2001::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2",
    "2001:2::1", "2001:10::1", "2001:db8::1", "3fff::1", "100::1", "fc00::1", "fd00:ec2::254",
    "fe80::1", "fec0::1", "ff02::1", "ff0e::1", "1::1", "4000::1", "8000::1",
]  # fmt: skip
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "100.63.255.255", "100.128.0.1",
          "172.32.0.1", "198.20.0.1", "2606:4700:4700::1111", "2a00:1450:4001:82b::200e",
          "2001:4860:4860::8888"]  # fmt: skip


@pytest.mark.parametrize("address", REFUSED)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not is_public(ipaddress.ip_address(address))
    assert not AddressPolicy().allows(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address: str) -> None:
    assert is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address", ["::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::", "fec0::1", "192.88.99.1"]
)
def test_stdlib_calls_these_global_and_the_gateway_does_not(address: str) -> None:
    # If a future Python fixes these, the row still holds; the gateway never relied on it.
    ip = ipaddress.ip_address(address)
    assert not is_public(ip)


def test_allowed_networks_open_only_their_range_and_family() -> None:
    policy = AddressPolicy(["127.0.0.0/8", "fd00:1::/64"])
    assert policy.allows(ipaddress.ip_address("127.0.0.1"))
    assert policy.allows(ipaddress.ip_address("fd00:1::5"))
    assert not policy.allows(ipaddress.ip_address("::ffff:127.0.0.1"))
    assert not policy.allows(ipaddress.ip_address("10.0.0.1"))
    assert not policy.allows(ipaddress.ip_address("169.254.169.254"))
    assert not policy.allows(ipaddress.ip_address("fd00:2::5"))
    assert policy.allows(ipaddress.ip_address("8.8.8.8"))


@pytest.mark.parametrize("entry", ["127.0.0.1/8", "not-a-net", "10.0.0.0/33"])
def test_malformed_allowed_networks_fail_at_start_up(entry: str) -> None:
    with pytest.raises(ValueError):
        AddressPolicy([entry])
