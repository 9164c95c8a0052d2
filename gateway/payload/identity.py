"""`Identity`: who is asking, for namespacing what a client names (media uuids,
session ids, cache salts) and for binding the response ids it creates to its key."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

# `gw-`, 32 hex digits of the id's own part, 32 of its tag.
_RESPONSE_ID_LENGTH = 67


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is asking, for namespacing what a client names: the key (its digest), the
    tenant its cache salt is shared with, and the deployment's HMAC secret."""

    owner: str
    tenant: str
    secret: bytes

    def namespaced(self, purpose: str, value: str, *, tenant: bool = False) -> str:
        owner = self.tenant if tenant else self.owner
        # Length-prefixed so no (owner, value) pair collides with another's concatenation.
        material = f"{purpose}:{len(owner)}:{owner}:{value}".encode()
        return "gw-" + hmac.new(self.secret, material, hashlib.sha256).hexdigest()

    # --- response ids: bound to the key that created them -----------------------------

    def response_id(self, value: str | None) -> str:
        """The request id (and stored response id) a body's `request_id` reaches the
        engine as: `gw-` + a part + the part's tag for this key. The part is namespaced
        from the client's value (the same value gives the same id, per key) or random
        when the client named none. `owns_response` checks the tag with nothing stored,
        so every worker and every replica with the same secret agrees."""
        part = self.namespaced("request_id", value)[3:35] if value else secrets.token_hex(16)
        return f"gw-{part}{self._response_tag(part)}"

    def owns_response(self, response_id: str) -> bool:
        """Whether `response_id` was made by `Identity.response_id` for this key."""
        if len(response_id) != _RESPONSE_ID_LENGTH or not response_id.isascii():
            return False
        if not response_id.startswith("gw-"):
            return False
        part, tag = response_id[3:35], response_id[35:]
        return hmac.compare_digest(tag, self._response_tag(part))

    def _response_tag(self, part: str) -> str:
        material = f"response:{len(self.owner)}:{self.owner}:{part}".encode()
        return hmac.new(self.secret, material, hashlib.sha256).hexdigest()[:32]
