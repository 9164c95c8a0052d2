"""Keys, scopes and the key file as tables of small cases (in-process)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from pydantic import SecretStr

from gateway.access.api_keys import KeyRing
from gateway.access.endpoints import FORWARDED_GROUPS, Group
from gateway.config.key_file import (
    ANONYMOUS,
    ApiKeyConfig,
    KeyConfigError,
    build_keys,
    hash_key,
    load_key_file,
)
from gateway.config.settings import load_settings
from gateway.errors import InvalidApiKey

PLAIN = "plain-key-0123456789abcdef"
OTHER = "other-key-0123456789abcdef"


def ring(*entries: str | ApiKeyConfig, anonymous: bool = False) -> KeyRing:
    keys = [e if isinstance(e, ApiKeyConfig) else SecretStr(e) for e in entries]
    return KeyRing(build_keys(keys), allow_unauthenticated=anonymous)


def test_hash_key_is_sha256_hex() -> None:
    assert hash_key(PLAIN) == "sha256:" + hashlib.sha256(PLAIN.encode()).hexdigest()


def test_plain_and_digest_forms_accept_the_same_key() -> None:
    for entry in (PLAIN, hash_key(PLAIN)):
        key = ring(entry).authenticate(b"Bearer " + PLAIN.encode())
        assert key.scopes == FORWARDED_GROUPS
        assert Group.metrics not in key.scopes
        assert key.models is None


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"",
        b"Bearer",
        b"Bearer ",
        b"Basic " + PLAIN.encode(),
        PLAIN.encode(),
        b"Bearer " + OTHER.encode(),
        b"Bearer " + PLAIN.encode()[:-1],
        b"Bearer " + hash_key(PLAIN).encode(),  # the digest itself is not a key
    ],
)
def test_refused_headers(header: bytes | None) -> None:
    with pytest.raises(InvalidApiKey) as info:
        ring(PLAIN).authenticate(header)
    assert info.value.status == 401
    assert info.value.headers["WWW-Authenticate"] == "Bearer"
    assert PLAIN not in info.value.message


def test_bearer_scheme_is_case_insensitive() -> None:
    assert ring(PLAIN).authenticate(b"bearer " + PLAIN.encode()).name == "key-1"


def test_object_keys_carry_name_scopes_models() -> None:
    r = ring(
        PLAIN,
        ApiKeyConfig(key=OTHER, name="tenant-b", scopes=["pooling", "metrics"], models=["m1"]),
    )
    key = r.authenticate(b"Bearer " + OTHER.encode())
    assert key.name == "tenant-b"
    assert key.scopes == {Group.pooling, Group.metrics}
    assert key.allows_model("m1") and not key.allows_model("m2")
    assert r.identify(b"Bearer " + OTHER.encode()) == "tenant-b"
    assert r.identify(b"Bearer nope") is None
    assert r.identify(None) is None


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["short"], "at least 16"),
        (["sha256:abcd"], "64 hex"),
        (["sha256:" + "zz" * 32], "64 hex"),
        ([PLAIN, hash_key(PLAIN)], "twice"),
        ([ApiKeyConfig(key=PLAIN, scopes=["root"])], "unknown scopes"),
        (
            [ApiKeyConfig(key=PLAIN, name="team"), ApiKeyConfig(key=OTHER, name="team")],
            "another key has this name",
        ),
        ([PLAIN, ApiKeyConfig(key=OTHER, name="key-1")], "another key has this name"),
        ([ApiKeyConfig(key=PLAIN, name="anonymous")], "another key has this name"),
    ],
)
def test_unusable_keys_are_config_errors(entries: list[str | ApiKeyConfig], message: str) -> None:
    with pytest.raises(KeyConfigError, match=message) as info:
        build_keys(entries)
    assert PLAIN not in str(info.value)


def test_anonymous_only_when_allowed() -> None:
    assert ring(anonymous=True).authenticate(None) is ANONYMOUS
    with pytest.raises(InvalidApiKey):
        ring(anonymous=True).authenticate(b"Bearer wrong-key-0123456789")
    with pytest.raises(InvalidApiKey):
        ring().authenticate(None)


def test_replace_swaps_keys() -> None:
    r = ring(PLAIN)
    r.replace(build_keys([OTHER]))
    assert r.authenticate(b"Bearer " + OTHER.encode()).name == "key-1"
    with pytest.raises(InvalidApiKey):
        r.authenticate(b"Bearer " + PLAIN.encode())


def test_key_file_forms(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(f"- {PLAIN}\n- key: {hash_key(OTHER)}\n  name: b\n  scopes: [inference]\n")
    keys = load_key_file(f)
    assert [k.name for k in keys] == ["key-1", "b"]
    f.write_text(f'{{"api_keys": ["{PLAIN}"]}}')
    assert len(load_key_file(f)) == 1
    f.write_text("")
    assert load_key_file(f) == ()


@pytest.mark.parametrize("text", ["{not yaml", "api_keys: 3", f"- key: {PLAIN}\n  bogus: 1\n"])
def test_bad_key_file_never_echoes_keys(tmp_path: Path, text: str) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(text)
    with pytest.raises(KeyConfigError) as info:
        load_key_file(f)
    assert PLAIN not in str(info.value)


@pytest.mark.parametrize("form", ["argument", "environment", "yaml"])
def test_plain_keys_never_show_in_settings(
    form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain key given in any form is a SecretStr: not in the settings' repr, str or
    dump, and still the key that authenticates."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    entries = [PLAIN, {"key": OTHER, "name": "b"}]
    if form == "argument":
        settings = load_settings(api_keys=entries)
    elif form == "environment":
        monkeypatch.setenv("GATEWAY_API_KEYS", json.dumps(entries))
        settings = load_settings()
    else:
        config = tmp_path / "gateway.yaml"
        config.write_text(f"api_keys:\n  - {PLAIN}\n  - key: {OTHER}\n    name: b\n")
        settings = load_settings(config)
    shown = repr(settings) + str(settings) + str(settings.model_dump())
    shown += settings.model_dump_json()
    assert PLAIN not in shown and OTHER not in shown
    assert isinstance(settings.api_keys[0], SecretStr)
    keys = KeyRing(build_keys(settings.api_keys))
    assert keys.authenticate(b"Bearer " + PLAIN.encode()).name == "key-1"
    assert keys.authenticate(b"Bearer " + OTHER.encode()).name == "b"
