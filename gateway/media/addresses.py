"""Which IP addresses the gateway may connect to when it fetches media.

`is_public` is default deny: an address is public only if it lies in the global unicast
space and in none of the special-purpose ranges below. It does not trust
`ipaddress.is_global` alone: on Python 3.11 that calls `::127.0.0.1`, `64:ff9b::7f00:1`,
`2002:7f00:1::`, `fec0::1` and `192.88.99.1` global, and `100.64.0.1` is neither private
nor global (tests/unit/media/test_addresses.py pins each case).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# IANA special-purpose registries (RFC 6890 and successors), plus ranges that embed an
# IPv4 address in IPv6 (a connection to them can reach the embedded IPv4 host).
_DENIED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network", unspecified
        "10.0.0.0/8",  # private
        "100.64.0.0/10",  # shared address space (carrier-grade NAT)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local, incl. the cloud metadata 169.254.169.254
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation TEST-NET-1
        "192.31.196.0/24",  # AS112
        "192.52.193.0/24",  # AMT
        "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
        "192.168.0.0/16",  # private
        "192.175.48.0/24",  # AS112 direct delegation
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation TEST-NET-2
        "203.0.113.0/24",  # documentation TEST-NET-3
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, incl. broadcast 255.255.255.255
    )
)
_GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")
_DENIED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "2001::/23",  # IETF protocol assignments: Teredo 2001::/32, benchmarking, ORCHID
        "2001:db8::/32",  # documentation
        "2002::/16",  # 6to4: embeds an IPv4 address
        "3fff::/20",  # documentation (RFC 9637)
        # Outside 2000::/3 and so refused anyway; listed so the table reads complete:
        "::/128",  # unspecified
        "::1/128",  # loopback
        "::/96",  # IPv4-compatible (deprecated)
        "::ffff:0:0/96",  # IPv4-mapped
        "64:ff9b::/96",  # NAT64 well-known prefix
        "64:ff9b:1::/48",  # NAT64 local-use prefix
        "100::/64",  # discard-only
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)


def is_public(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv4Address):
        return address.is_global and not any(address in net for net in _DENIED_V4)
    if address not in _GLOBAL_UNICAST_V6:
        return False
    return address.is_global and not any(address in net for net in _DENIED_V6)


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """Parse ALLOWED_NETWORKS; a malformed entry is a configuration error (ValueError)."""
    return tuple(ipaddress.ip_network(entry.strip(), strict=True) for entry in entries)


class AddressPolicy:
    """Public addresses, plus the operator's ALLOWED_NETWORKS (an internal image store)."""

    def __init__(self, allowed_networks: Iterable[str] = ()) -> None:
        self._allowed = parse_networks(allowed_networks)

    def allows(self, address: Address) -> bool:
        # An IPv4-mapped IPv6 address never matches an IPv4 network here: it is refused,
        # which is the safe reading.
        if any(address.version == net.version and address in net for net in self._allowed):
            return True
        return is_public(address)
