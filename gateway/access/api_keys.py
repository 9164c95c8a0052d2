"""The keys in force and the constant-time check of a presented key.

Keys are held only as SHA-256 digests. A presented key is hashed once and compared with
`hmac.compare_digest` against every configured digest, without stopping at the first
match, so the time taken says nothing about which key or how much of it matched
(CVE-2025-59425: vLLM's `==` comparison of keys leaked timing).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from gateway.config.key_file import ANONYMOUS, ApiKey
from gateway.errors import InvalidApiKey

_BEARER = b"bearer "


class KeyRing:
    """The keys in force. `replace` swaps the whole set at once (key-file reloads)."""

    def __init__(self, keys: Sequence[ApiKey], *, allow_unauthenticated: bool = False) -> None:
        self.keys: tuple[ApiKey, ...] = tuple(keys)
        self.allow_unauthenticated = allow_unauthenticated

    def replace(self, keys: Sequence[ApiKey]) -> None:
        self.keys = tuple(keys)

    def authenticate(self, authorization: bytes | None) -> ApiKey:
        """The key presented in an `Authorization` header value, or InvalidApiKey."""
        if authorization is None:
            if self.allow_unauthenticated:
                return ANONYMOUS
            raise InvalidApiKey("Missing API key: send it as 'Authorization: Bearer <key>'.")
        if authorization[:7].lower() != _BEARER:
            raise InvalidApiKey("Only 'Authorization: Bearer <key>' is accepted.")
        digest = hashlib.sha256(authorization[7:].strip()).digest()
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(key.digest, digest) and found is None:
                found = key
        if found is None:
            raise InvalidApiKey("Invalid API key.")
        return found

    def identify(self, authorization: bytes | None) -> str | None:
        """The name of the presented key, for logging refused requests; None if invalid."""
        try:
            return self.authenticate(authorization).name if authorization else None
        except InvalidApiKey:
            return None
