"""gateway/access/clients.py in-process, as tables: the peer's normal form, the walk of
X-Forwarded-For from the right past trusted proxies, and the settings that configure it.
Through real processes (the log line's `client`, the throttle per forwarded client): in
tests/e2e/test_callers.py."""

from __future__ import annotations

import json

import pytest

from gateway.access.clients import ClientAddresses, normalise
from gateway.config.settings import Settings
from gateway.types import Scope

KEYS = ["sk-clients-0123456789abcdef"]


def scope(peer: str | None, *xff: bytes) -> Scope:
    return {
        "type": "http",
        "client": None if peer is None else (peer, 50000),
        "headers": [(b"x-forwarded-for", value) for value in xff],
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:DB8:0:0::1", "2001:db8::1"),
        ("::ffff:198.51.100.9", "198.51.100.9"),
        ("::ffff:c633:6409", "198.51.100.9"),
        ("::1", "::1"),
        # Not a bare address: refused, never guessed at.
        ("203.0.113.7:443", None),
        ("[2001:db8::1]", None),
        ("[2001:db8::1]:443", None),
        ("fe80::1%eth0", None),
        ("example.com", None),
        ("unknown", None),
        ("", None),
        ("203.0.113.007", None),
        ("1.2.3", None),
        ("203.0.113.7 203.0.113.8", None),
    ],
)
def test_normalise(text: str, expected: str | None) -> None:
    assert normalise(text) == expected


TRUSTED = ["127.0.0.1/32", "10.0.0.0/8", "fd00::/8"]


@pytest.mark.parametrize(
    ("trusted", "peer", "xff", "client"),
    [
        # Without trusted proxies, the peer, whatever the header says.
        ([], "203.0.113.7", [b"198.51.100.1"], "203.0.113.7"),
        ([], "::ffff:203.0.113.7", [], "203.0.113.7"),
        # From a peer outside them, the header is the client's own text: ignored.
        (TRUSTED, "203.0.113.7", [b"198.51.100.1"], "203.0.113.7"),
        # From a trusted peer: the rightmost address that is not a trusted proxy's.
        (TRUSTED, "127.0.0.1", [b"198.51.100.1"], "198.51.100.1"),
        (TRUSTED, "::ffff:127.0.0.1", [b"198.51.100.1"], "198.51.100.1"),
        (TRUSTED, "127.0.0.1", [b"198.51.100.1, 10.1.2.3"], "198.51.100.1"),
        (TRUSTED, "127.0.0.1", [b"1.1.1.1, 198.51.100.1, 10.1.2.3"], "198.51.100.1"),
        (TRUSTED, "127.0.0.1", [b"198.51.100.1,10.1.2.3,fd00::5"], "198.51.100.1"),
        (TRUSTED, "10.0.0.9", [b"2001:DB8::1"], "2001:db8::1"),
        (TRUSTED, "127.0.0.1", [b"::ffff:198.51.100.1"], "198.51.100.1"),
        # Every header line, in order, joined: the last line's entries are the rightmost.
        (TRUSTED, "127.0.0.1", [b"198.51.100.1", b"10.1.2.3"], "198.51.100.1"),
        (TRUSTED, "127.0.0.1", [b"10.1.2.3", b"198.51.100.1"], "198.51.100.1"),
        (TRUSTED, "127.0.0.1", [b"1.1.1.1", b"198.51.100.1, 10.1.2.3"], "198.51.100.1"),
        # A trusted peer that forwarded nothing is the client.
        (TRUSTED, "127.0.0.1", [], "127.0.0.1"),
        # Every hop trusted: the farthest one.
        (TRUSTED, "127.0.0.1", [b"10.9.9.9, 10.1.2.3"], "10.9.9.9"),
        # A malformed entry stops the walk at the last trusted hop: garbage never names
        # the client, and what is left of it is not read.
        (TRUSTED, "127.0.0.1", [b"garbage"], "127.0.0.1"),
        (TRUSTED, "127.0.0.1", [b""], "127.0.0.1"),
        (TRUSTED, "127.0.0.1", [b"198.51.100.1, garbage"], "127.0.0.1"),
        (TRUSTED, "127.0.0.1", [b"198.51.100.1, garbage, 10.1.2.3"], "10.1.2.3"),
        (TRUSTED, "127.0.0.1", [b"198.51.100.1,"], "127.0.0.1"),
        (TRUSTED, "127.0.0.1", [b"198.51.100.1:5555"], "127.0.0.1"),
        (TRUSTED, "127.0.0.1", [b"[2001:db8::1]"], "127.0.0.1"),
        (TRUSTED, "127.0.0.1", [b"unknown, 10.1.2.3"], "10.1.2.3"),
        (TRUSTED, "127.0.0.1", ["198.51.100.1\u00e9".encode()], "127.0.0.1"),
        # Spaces around entries are the header's own.
        (TRUSTED, "127.0.0.1", [b"  198.51.100.1  ,  10.1.2.3 "], "198.51.100.1"),
        # An untrusted address to the left of an untrusted one is never reached.
        (TRUSTED, "127.0.0.1", [b"10.1.2.3, 198.51.100.1"], "198.51.100.1"),
    ],
)
def test_forwarded_for_walk(trusted: list[str], peer: str, xff: list[bytes], client: str) -> None:
    assert ClientAddresses(trusted).of(scope(peer, *xff)) == client


def test_no_peer_is_no_client() -> None:
    assert ClientAddresses(TRUSTED).of(scope(None, b"198.51.100.1")) is None
    assert ClientAddresses().of({"type": "http", "headers": []}) is None


def test_peer_only_when_forwarded_is_not_read() -> None:
    """A request refused before its headers are read (too many of them) is its peer's."""
    clients = ClientAddresses(TRUSTED)
    assert clients.of(scope("127.0.0.1", b"198.51.100.1"), forwarded=False) == "127.0.0.1"


def test_peers_are_cached_boundedly() -> None:
    clients = ClientAddresses()
    for n in range(5000):
        assert clients.of(scope(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}")) is not None
    assert len(clients._peers) <= 4096


@pytest.mark.parametrize(
    "entries", [["10.0.0.1/8"], ["not-a-network"], ["10.0.0.0/33"], ["127.0.0.1/32", "fd00::1/8"]]
)
def test_trusted_proxies_must_be_networks(entries: list[str]) -> None:
    with pytest.raises(ValueError, match="is not a network"):
        Settings(api_keys=KEYS, trusted_proxies=entries)


def test_trusted_proxies_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TRUSTED_PROXIES", json.dumps(["10.0.0.0/8", "127.0.0.1/32"]))
    settings = Settings(api_keys=KEYS)
    assert settings.trusted_proxies == ["10.0.0.0/8", "127.0.0.1/32"]
    assert Settings(api_keys=KEYS).limits.auth_failures == 20
