"""Client keys as configured: parsed from the settings' `api_keys` or from the key file.

Keys are held only as SHA-256 digests; a plain key in the settings is hashed here and
never kept. Checking a presented key is `KeyRing`'s job (gateway/access/api_keys.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError

from gateway.access.endpoints import ALL_SCOPES, FORWARDED_GROUPS, Group
from gateway.config.sources import repeated_key, suggest

_DIGEST_PREFIX = "sha256:"


class RateLimit(BaseModel):
    """A token bucket: `requests_per_second` refill, up to `burst` requests at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_second: float = Field(gt=0)
    # None: one second's worth of requests (at least 1).
    burst: int | None = Field(default=None, ge=1)

    @property
    def capacity(self) -> int:
        return self.burst if self.burst is not None else max(1, math.ceil(self.requests_per_second))


class ApiKeyConfig(BaseModel):
    """One client key. `key` is the plain key or its `sha256:<hex>` digest."""

    # A misspelt `scopes` must not silently leave a key with every scope.
    model_config = ConfigDict(extra="forbid")

    key: SecretStr
    name: str | None = None
    # None: every forwarded route group. A list: only these groups (and `metrics`).
    scopes: list[str] | None = None
    # None: every served model. A list: only these.
    models: list[str] | None = None
    # Keys with the same tenant share a prefix-cache salt (payload.cache_isolation: tenant).
    tenant: str | None = None
    # This key's own limits, in place of limits.max_in_flight_per_key and
    # limits.rate_per_key (gateway/access/admission.py).
    max_in_flight: int | None = Field(default=None, gt=0)
    rate: RateLimit | None = None


class KeyConfigError(ValueError):
    """A key list that cannot be used. The message never contains a key."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A configured client key: its digest, a name for logs, and what it may use."""

    name: str
    digest: bytes
    # Route groups this key may use. A key configured without scopes gets every
    # forwarded group but not `metrics` or `admin` (the gateway's metrics and control
    # routes): granted only explicitly, so a leaked inference key does not also map
    # the deployment.
    scopes: frozenset[Group]
    # None: every served model.
    models: frozenset[str] | None
    # Shares a prefix-cache salt with the keys of the same tenant; None: its own.
    tenant: str | None = None
    # Its own in-flight cap and rate limit; None: the defaults in `limits`.
    max_in_flight: int | None = None
    rate: RateLimit | None = None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


# Used when the operator set allow_unauthenticated and a request carries no key.
ANONYMOUS = ApiKey("anonymous", b"", FORWARDED_GROUPS, None)


def hash_key(key: str) -> str:
    """The `sha256:<hex>` form of a plain key, for config files."""
    return _DIGEST_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def _digest(secret: str) -> bytes:
    if secret.startswith(_DIGEST_PREFIX):
        hexdigest = secret[len(_DIGEST_PREFIX) :]
        try:
            raw = bytes.fromhex(hexdigest)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise KeyConfigError("a sha256: key must be followed by 64 hex digits")
        return raw
    if len(secret) < 16:
        raise KeyConfigError(
            "a plain API key must be at least 16 characters long "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(24))'`)"
        )
    return hashlib.sha256(secret.encode("utf-8")).digest()


def _scopes(names: list[str] | None, label: str) -> frozenset[Group]:
    if names is None:
        return FORWARDED_GROUPS
    unknown = sorted(set(names) - {g.value for g in ALL_SCOPES})
    if unknown:
        raise KeyConfigError(
            f"key {label!r} has unknown scopes {', '.join(unknown)}; "
            f"known: {', '.join(sorted(g.value for g in ALL_SCOPES))}"
        )
    return frozenset(Group(n) for n in names)


def build_keys(
    entries: Iterable[SecretStr | ApiKeyConfig], *, first: int = 1
) -> tuple[ApiKey, ...]:
    """Turn configured entries into keys, one per entry and in order; raises
    KeyConfigError for unusable entries. An unnamed entry is named `key-<n>`, numbered
    from `first`: the key file's entries are numbered on from the settings' own, so the
    names made for the two sources never meet (`join_sources`)."""
    keys: list[ApiKey] = []
    seen: set[bytes] = set()
    names: set[str] = set()
    for index, entry in enumerate(entries, start=first):
        cfg = entry if isinstance(entry, ApiKeyConfig) else ApiKeyConfig(key=entry)
        label = cfg.name or f"key-{index}"
        # Names label logs and metrics: two keys under one name could not be told apart.
        if label in names or label == ANONYMOUS.name:
            raise KeyConfigError(f"{label}: another key has this name")
        names.add(label)
        try:
            digest = _digest(cfg.key.get_secret_value())
        except KeyConfigError as exc:
            raise KeyConfigError(f"{label}: {exc}") from None
        if digest in seen:
            raise KeyConfigError(f"{label}: the same key is configured twice")
        seen.add(digest)
        models = frozenset(cfg.models) if cfg.models is not None else None
        scopes = _scopes(cfg.scopes, label)
        keys.append(ApiKey(label, digest, scopes, models, cfg.tenant, cfg.max_in_flight, cfg.rate))
    return tuple(keys)


_ENTRIES: TypeAdapter[list[SecretStr | ApiKeyConfig]] = TypeAdapter(list[SecretStr | ApiKeyConfig])


def load_key_file(path: Path, *, first: int = 1) -> tuple[ApiKey, ...]:
    """Keys from a YAML (or JSON) file: a list of entries, or `{api_keys: [...]}`; an
    unnamed one is numbered from `first` (build_keys)."""
    try:
        text = path.read_text(encoding="utf-8")
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data: Any = yaml.safe_load(text)
    except FileNotFoundError:
        raise KeyConfigError(f"key file {path} not found") from None
    except (OSError, UnicodeDecodeError):
        raise KeyConfigError(f"key file {path} cannot be read") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise KeyConfigError(f"key file {where} is not valid YAML") from None
    # Refused like in the settings file; named by line only (a mapping key may be a key).
    repeat = None if root is None else repeated_key(root)
    if repeat is not None:
        _, line, first = repeat
        raise KeyConfigError(
            f"key file {path}:{line}: a field is given twice (first on line {first})"
        )
    if isinstance(data, dict) and set(data) == {"api_keys"}:
        data = data["api_keys"]
    if data is None:
        data = []
    try:
        entries = _ENTRIES.validate_python(data)
    except ValidationError as exc:
        raise KeyConfigError(f"key file {path}: {_entry_errors(exc)}") from None
    return build_keys(entries, first=first)


def join_sources(
    own: tuple[ApiKey, ...], from_file: tuple[ApiKey, ...], path: Path
) -> tuple[ApiKey, ...]:
    """The settings' own keys, then the key file's, each a list of its entries in order
    (build_keys). A key or a name in both is refused, naming both places: the first
    match would win authentication and the other entry's scopes, models and limits
    would be silently ignored, and two keys under one name are metered as one."""
    digests = {key.digest: n for n, key in enumerate(own, start=1)}
    names = {key.name: n for n, key in enumerate(own, start=1)}
    for n, key in enumerate(from_file, start=1):
        where = f"key file {path} entry {n}"
        if key.digest in digests:
            raise KeyConfigError(f"api_keys entry {digests[key.digest]} and {where}: the same key")
        if key.name in names:
            raise KeyConfigError(
                f'api_keys entry {names[key.name]} and {where}: the name "{key.name}" is used twice'
            )
    return own + from_file


def _entry_errors(exc: ValidationError) -> str:
    """What is wrong with a key file's entries, from pydantic's locations and messages
    only: its full text would quote the offending value, which may be a key."""
    found: list[str] = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = error["loc"]
        # (index, "ApiKeyConfig", field, ...): a field of an object entry.
        if len(loc) > 2 and loc[1] == ApiKeyConfig.__name__:
            field = ".".join(str(part) for part in loc[2:])
            msg = error["msg"]
            if error["type"] == "extra_forbidden":
                msg = f"unknown field{suggest(field, list(ApiKeyConfig.model_fields))}"
            found.append(f"entry {int(loc[0]) + 1}: {field}: {msg}")
    if found:
        return "; ".join(found)
    return (
        "expected a list of keys, `sha256:<hex>` digests or objects with key, name, "
        "scopes, models, tenant, max_in_flight, rate"
    )
