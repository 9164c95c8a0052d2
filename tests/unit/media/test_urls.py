"""The URL policy as tables: parser differentials, encodings of internal addresses,
look-alike hosts, schemes and data URLs. Each refusal names its rule."""

from __future__ import annotations

import base64
import binascii
import random

import pytest

from bench.harness.samples import data_url
from gateway.errors import MediaInvalid, MediaTooLarge, MediaUrlNotAllowed
from gateway.media.settings import MediaSettings
from gateway.media.types import MediaMode
from gateway.media.urls import DataUrl, RemoteUrl, UrlPolicy, parse_domain_rule

POLICY = UrlPolicy(
    MediaSettings(
        allowed_domains=[
            "allowed.example",
            "*.cdn.example",
            "ports.example:8443",
            "127.0.0.1:9000",
            "[2001:db8::5]:8080",
        ],
        allowed_schemes=["https", "http"],
        max_url_length=200,
        max_bytes=1000,
    )
)


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("https://allowed.example/a.png", "https://allowed.example/a.png"),
        ("HTTPS://ALLOWED.EXAMPLE/a.png", "https://allowed.example/a.png"),
        ("https://allowed.example", "https://allowed.example/"),
        ("https://allowed.example?x=1", "https://allowed.example/?x=1"),
        ("https://allowed.example:443/a", "https://allowed.example/a"),
        ("http://allowed.example:80/a", "http://allowed.example/a"),
        ("https://img.cdn.example/a%20b.png?w=1&h=2", "https://img.cdn.example/a%20b.png?w=1&h=2"),
        ("https://a.b.cdn.example/x", "https://a.b.cdn.example/x"),
        ("https://ports.example:8443/x", "https://ports.example:8443/x"),
        ("http://127.0.0.1:9000/img.png", "http://127.0.0.1:9000/img.png"),
        ("http://[2001:db8::5]:8080/x", "http://[2001:db8::5]:8080/x"),
        ("http://[2001:0db8:0:0::5]:8080/x", "http://[2001:db8::5]:8080/x"),
        # '@' after the first '/' is path, for every RFC 3986 parser.
        ("https://allowed.example/x@evil.example/", "https://allowed.example/x@evil.example/"),
    ],
)
def test_accepted_urls_are_canonical(raw: str, canonical: str) -> None:
    ref = POLICY.check(raw)
    assert isinstance(ref, RemoteUrl)
    assert ref.canonical == canonical


@pytest.mark.parametrize(
    ("raw", "rule"),
    [
        # Public vLLM bypasses: one parser checked, another fetched.
        ("http://allowed.example\\@evil.example/", "backslash"),  # CVE-2026-24779
        ("http://127.0.0.1:9000\\@allowed.example/", "backslash"),  # CVE-2026-25960
        ("https://allowed.example\\.evil.example/", "backslash"),
        ("https://evil.example\\allowed.example/", "backslash"),
        # Userinfo in every spelling.
        ("https://user@allowed.example/", "userinfo"),
        ("https://allowed.example@evil.example/", "userinfo"),
        ("https://evil.example@allowed.example/", "userinfo"),
        ("https://a:b@allowed.example/", "userinfo"),
        ("https://@allowed.example/", "userinfo"),
        ("https://allowed.example%40evil.example/", "host"),
        # Fragments and authority tricks.
        ("https://allowed.example#@evil.example/", "fragment"),
        ("https://evil.example#.allowed.example/", "fragment"),
        ("https://evil.example?.allowed.example/", "domain"),
        ("https://evil.example/.allowed.example", "domain"),
        ("https:/allowed.example/", "authority"),
        ("https:allowed.example/", "authority"),
        ("https:///allowed.example/", "host"),
        ("https://", "host"),
        ("//allowed.example/a.png", "scheme"),
        # Whitespace, control and non-ASCII characters.
        ("https://allowed.example /a", "whitespace"),
        (" https://allowed.example/a", "scheme"),
        ("https://allowed.example/a\n", "whitespace"),
        ("https://allowed.example\t/a", "whitespace"),
        ("https://allowed.example\x00.evil/a", "whitespace"),
        ("https://allowed.example/\x7f", "whitespace"),
        ("https://allowеd.example/", "non_ascii"),  # Cyrillic 'е'
        ("https://allowed.exam\u0440le/", "non_ascii"),
        ("https://ａllowed.example/", "non_ascii"),  # fullwidth 'a'
        ("https://allowed.example\u3002evil/", "non_ascii"),  # ideographic full stop
        ("https://allowed.example/\u202e", "non_ascii"),
        # Percent-encoded or odd hosts.
        ("https://%61llowed.example/", "host"),
        ("https://allowed.example./a", "host"),
        ("https://allowed..example/", "host"),
        ("https://-allowed.example/", "host"),
        ("https://allowed_example/", "host"),
        ("https://[::1/", "host"),
        ("https://[::1]x/", "host"),
        ("https://[fe80::1%25eth0]/", "host"),
        ("https://a:b:c/", "host"),
        # Look-alikes and IDN hosts never match an exact rule.
        ("https://xn--allowd-4ve.example/", "domain"),
        ("https://allowed.example.evil.example/", "domain"),
        ("https://evilallowed.example/", "domain"),
        ("https://allowed-example/", "domain"),
        ("https://cdn.example/", "domain"),  # a wildcard covers subdomains only
        ("https://xcdn.example/", "domain"),
        ("https://localhost/", "domain"),
        ("https://metadata.google.internal/", "domain"),
        # Ports: a bare host allows only the default port.
        ("https://allowed.example:8443/", "domain"),
        ("https://ports.example/", "domain"),
        ("https://ports.example:8444/", "domain"),
        ("https://allowed.example:/", "port"),
        ("https://allowed.example:0443/", "port"),
        ("https://allowed.example:+443/", "port"),
        ("https://allowed.example:0/", "port"),
        ("https://allowed.example:65536/", "port"),
        ("https://allowed.example:99999999/", "port"),
        ("https://allowed.example:44 3/", "whitespace"),
        ("https://allowed.example:0x1bb/", "port"),
        # Every encoding of loopback, private and metadata addresses.
        ("http://127.0.0.1/", "ip_literal"),
        ("http://127.0.0.1:9001/", "ip_literal"),
        ("http://2130706433/", "ip_literal"),
        ("http://2130706433:9000/", "ip_literal"),
        ("http://0x7f000001/", "ip_literal"),
        ("http://0x7f.0.0.1/", "ip_literal"),
        ("http://0177.0.0.1/", "ip_literal"),
        ("http://0177.0.0.01:9000/", "ip_literal"),
        ("http://127.1/", "ip_literal"),
        ("http://127.1:9000/", "ip_literal"),
        ("http://127.0.1/", "ip_literal"),
        ("http://0/", "ip_literal"),
        ("http://0.0.0.0/", "ip_literal"),
        ("http://169.254.169.254/latest/meta-data/", "ip_literal"),
        ("http://2852039166/", "ip_literal"),  # 169.254.169.254
        ("http://0xa9fea9fe/", "ip_literal"),
        ("http://0251.0376.0251.0376/", "ip_literal"),
        ("http://10.0.0.1/", "ip_literal"),
        ("http://192.168.1.1/", "ip_literal"),
        ("http://100.64.0.1/", "ip_literal"),
        ("http://[::1]/", "ip_literal"),
        ("http://[::]/", "ip_literal"),
        ("http://[::ffff:127.0.0.1]/", "ip_literal"),
        ("http://[::ffff:7f00:1]:9000/", "ip_literal"),
        ("http://[::127.0.0.1]/", "ip_literal"),
        ("http://[64:ff9b::7f00:1]/", "ip_literal"),
        ("http://[64:ff9b:1::a9fe:a9fe]/", "ip_literal"),
        ("http://[2002:7f00:1::]/", "ip_literal"),
        ("http://[2001::1]/", "ip_literal"),
        ("http://[fd00:ec2::254]/", "ip_literal"),
        ("http://[fe80::1]/", "ip_literal"),
        ("http://[2001:db8::5]/", "ip_literal"),  # listed with a port only
        ("http://allowed.example.127/", "ip_literal"),
        ("http://example.0x7f/", "ip_literal"),
        # Schemes and local files.
        ("file:///etc/passwd", "scheme"),
        ("file://allowed.example/etc/passwd", "scheme"),
        ("FILE:///etc/passwd", "scheme"),
        ("ftp://allowed.example/a.png", "scheme"),
        ("gopher://allowed.example:70/_x", "scheme"),
        ("http+unix://%2Fvar%2Frun%2Fdocker.sock/info", "scheme"),
        ("jar:https://allowed.example/a!/b", "scheme"),
        ("ws://allowed.example/", "scheme"),
        ("javascript:alert(1)", "scheme"),
        ("/etc/passwd", "scheme"),
        ("etc/passwd", "scheme"),
        ("./a.png", "scheme"),
        ("C:\\Windows\\win.ini", "backslash"),
        ("", "scheme"),
        ("https://allowed.example/" + "a" * 200, "length"),
        # Path characters that parsers disagree on.
        ("https://allowed.example/a%zz", "path"),
        ("https://allowed.example/a%", "path"),
        ("https://allowed.example/a|b", "path"),
        ("https://allowed.example/a{b}", "path"),
        ('https://allowed.example/a"b', "path"),
        ("https://allowed.example/a<b>", "path"),
        ("https://allowed.example/a^b", "path"),
        ("https://allowed.example/a`b", "path"),
        # Data URLs that are not base64 or name no type.
        ("data:,hello", "data_url"),
        ("data:image/png,rawbytes", "data_url"),
        ("data:;base64,aGVsbG8=", "data_url"),
        ("data:image/png;base64", "data_url"),
    ],
)
def test_refused_urls_name_their_rule(raw: str, rule: str) -> None:
    with pytest.raises(MediaUrlNotAllowed) as info:
        POLICY.check(raw)
    assert info.value.status == 400
    assert info.value.code == "media_url_not_allowed"
    assert f"(rule: {rule})" in info.value.message
    # The client's URL is never echoed back.
    assert "evil" not in info.value.message


@pytest.mark.parametrize("raw", [None, 1, ["https://allowed.example/"], {"url": "x"}])
def test_non_string_urls_are_refused(raw: object) -> None:
    with pytest.raises(MediaUrlNotAllowed):
        POLICY.check(raw)


def test_https_only_by_default_and_empty_allowlist_allows_nothing() -> None:
    policy = UrlPolicy(MediaSettings(allowed_domains=["allowed.example"]))
    with pytest.raises(MediaUrlNotAllowed, match="rule: scheme"):
        policy.check("http://allowed.example/a.png")
    assert isinstance(policy.check("https://allowed.example/a.png"), RemoteUrl)
    empty = UrlPolicy(MediaSettings())
    with pytest.raises(MediaUrlNotAllowed, match="rule: domain"):
        empty.check("https://allowed.example/a.png")


def test_data_only_mode_refuses_remote_urls() -> None:
    policy = UrlPolicy(MediaSettings(mode=MediaMode.data_only, allowed_domains=["a.example"]))
    with pytest.raises(MediaUrlNotAllowed, match="rule: mode"):
        policy.check("https://a.example/x.png")
    assert isinstance(policy.check("data:image/png;base64,iVBORw=="), DataUrl)


def test_data_urls_decode_strictly() -> None:
    ref = POLICY.check("data:image/png;base64," + base64.b64encode(b"abc").decode())
    assert isinstance(ref, DataUrl) and (ref.mime, ref.data) == ("image/png", b"abc")
    frames = ",".join(base64.b64encode(b).decode() for b in (b"one", b"two"))
    video = POLICY.check("data:video/jpeg;base64," + frames)
    assert isinstance(video, DataUrl) and video.frames == (b"one", b"two")
    with pytest.raises(MediaInvalid):
        POLICY.check("data:image/png;base64,not base64!")
    with pytest.raises(MediaInvalid):
        POLICY.check("data:image/png;base64,YWJj,YWJj")  # commas only for video/jpeg
    with pytest.raises(MediaInvalid):
        POLICY.check("data:image/png;base64,")
    with pytest.raises(MediaTooLarge):
        POLICY.check("data:image/png;base64," + "A" * 2000)


@pytest.mark.parametrize(
    "entry", ["*.127.0.0.1", "exa mple.com", "ex%61mple.com", "host:99999", "a@b", "[::1"]
)
def test_bad_allowlist_entries_fail_at_start_up(entry: str) -> None:
    with pytest.raises((ValueError, MediaUrlNotAllowed)):
        parse_domain_rule(entry)
    with pytest.raises(ValueError):
        UrlPolicy(MediaSettings(allowed_domains=[entry]))


@pytest.mark.parametrize("scheme", ["file", "ftp", "data", "gopher"])
def test_only_http_schemes_can_be_configured(scheme: str) -> None:
    with pytest.raises(ValueError):
        UrlPolicy(MediaSettings(allowed_schemes=["https", scheme]))


# Payloads next to whether base64.b64decode(validate=True) takes them: the check runs
# without decoding, and must agree with it exactly.
@pytest.mark.parametrize(
    "payload",
    ["YWJj", "YWI=", "YQ==", "YQ", "YQ=", "Y===", "YWJjZA", "YWJjZ", "YW=j", "=YWJ",
     "YWJj\n", " YWJj", "YW Jj", "YWJj-_==", "YWJj====", "YWJjYQ==YQ==", "ééé=",
     "QR==", "QUI=", "QUJ=", "////", "++++", "a", "aa", "aaa", "aaaa", "YWJj=", "YWJj=====",
     "YQ===", "YWI==", "====", "=", "Y=", "Y==", "YQ=A", "YQ==YQ=="],
)  # fmt: skip
def test_the_base64_check_agrees_with_the_strict_decoder(payload: str) -> None:
    _assert_check_agrees_with_the_strict_decoder(payload)


def test_the_base64_check_agrees_on_random_payloads() -> None:
    rng = random.Random(16)
    alphabet = "AQYZaz09+/=====-_ \n."
    for _ in range(20000):
        payload = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 13)))
        _assert_check_agrees_with_the_strict_decoder(payload)


def test_the_base64_check_and_decoder_agree_on_long_payloads() -> None:
    """Long payloads take the SIMD decoder's vector paths (short ones its scalar tail):
    valid ones, with padding the strict decoder lets by, with unused bits set, and with
    one character anywhere replaced by one outside the alphabet or by `=`."""
    rng = random.Random(161)
    for _ in range(1500):
        data = rng.randbytes(rng.randrange(1, 1000))  # POLICY's max_bytes
        text = base64.b64encode(data).decode()
        _assert_check_agrees_with_the_strict_decoder(text)
        _assert_check_agrees_with_the_strict_decoder(text.rstrip("=") + "=" * rng.randrange(5))
        if text.endswith("="):
            last = text.rstrip("=")
            bits = last[:-1] + rng.choice("BCDEFGHJKLMNOPRS") + text[len(last) :]
            _assert_check_agrees_with_the_strict_decoder(bits)
        at = rng.randrange(len(text))
        bad = text[:at] + rng.choice("=-_ \n.é") + text[at + 1 :]
        _assert_check_agrees_with_the_strict_decoder(bad)


def _assert_check_agrees_with_the_strict_decoder(payload: str) -> None:
    """The URL check accepts exactly what `b64decode(validate=True)` accepts (an empty
    payload included as refused), and keeps the same bytes."""
    try:
        expected: bytes | None = base64.b64decode(payload, validate=True) or None
    except (binascii.Error, ValueError):
        expected = None
    try:
        ref = POLICY.check("data:image/png;base64," + payload)
    except MediaInvalid:
        assert expected is None, payload
    else:
        assert isinstance(ref, DataUrl) and ref.data == expected, payload


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("data:image/png;base64,YWJj", True),
        ("data:image/png;base64,YQ==", True),
        ("data:image/png;base64,YR==", False),  # unused bits set: re-encoding gives YQ==
        ("data:image/png;base64,YWI=", True),
        ("data:image/png;base64,YWJj=", False),  # padding the strict decoder lets by
        ("data:image/png;base64,YWJj====", False),
        ("data:image/png;base64,YWJ=", False),
        ("data:IMAGE/PNG;base64,YWJj", False),  # the gateway writes the type in lower case
        ("data:image/png;charset=x;base64,YWJj", False),
        ("data:image/png;BASE64,YWJj", False),
    ],
)
def test_a_data_url_is_canonical_only_when_it_is_what_the_gateway_would_write(
    url: str, canonical: bool
) -> None:
    ref = POLICY.check(url)
    assert isinstance(ref, DataUrl) and ref.canonical is canonical
    assert (data_url(ref.mime, ref.data) == url) is canonical
