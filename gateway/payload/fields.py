"""The fields a body may carry: the opt-ins that let a refused field through, and the
checks and rewrites of a body's top-level fields (engine controls refused, identifiers
namespaced per key, request ids bound to the key). The media walk (walk.py) asks
`FieldRules` about the fields it meets at any depth.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import FieldNotAllowed, InvalidRequest, ResponseNotFound
from gateway.media.settings import MediaSettings
from gateway.payload.identity import Identity
from gateway.payload.lax import lax_bool
from gateway.payload.rules import (
    FORBIDDEN_ANYWHERE,
    FORBIDDEN_TOP_LEVEL,
    FORBIDDEN_TYPES,
    NAMESPACED_TOP_LEVEL,
    OptIn,
)
from gateway.payload.settings import CacheIsolation, PayloadSettings


def opted_in(media: MediaSettings, payload: PayloadSettings) -> frozenset[OptIn]:
    """The opt-ins the settings turn on: each `OptIn` read from its typed setting."""
    settings = {
        OptIn.prompt_embeds: media.allow_prompt_embeds,
        OptIn.embeds_parts: media.allow_embeds_parts,
        OptIn.kv_transfer_params: media.allow_kv_transfer_params,
        OptIn.ec_transfer_params: media.allow_ec_transfer_params,
        OptIn.media_io_kwargs: media.allow_media_io_kwargs,
        OptIn.mm_processor_kwargs: media.allow_mm_processor_kwargs,
        OptIn.chat_template: media.allow_chat_template,
        OptIn.pooling_data: payload.allow_pooling_data,
        OptIn.priority: payload.allow_priority,
        OptIn.background: payload.allow_background,
        OptIn.mcp_headers: payload.allow_mcp_headers,
    }
    return frozenset(opt for opt, on in settings.items() if on)


# The top-level fields `check_top_level` looks at besides `cache_salt`: a body holding none
# of them (most do) skips those checks, each of which would find its field absent.
_TOP_LEVEL_CHECKED: frozenset[str] = frozenset(
    {
        *FORBIDDEN_TOP_LEVEL,
        *NAMESPACED_TOP_LEVEL,
        "vllm_xargs",
        "background",
        "tools",
        "request_id",
        "previous_response_id",
    }
)
# Namespaced cache salts kept (`FieldRules._salted`); past it the memo starts afresh.
_SALTS_KEPT = 4096


class FieldRules:
    """The field checks of one configuration, built once: `check_top_level` for a
    body's top level, `check_anywhere` and `check_part_type` for what the walk meets."""

    def __init__(self, media: MediaSettings, payload: PayloadSettings) -> None:
        self.allowed = opted_in(media, payload)
        self.xargs_keys = frozenset(payload.vllm_xargs_keys)
        self.cache_isolation = payload.cache_isolation
        self.max_cache_salt_length = media.max_cache_salt_length
        # (secret, owner or tenant, salt) -> the salt sent: an HMAC a request, the same
        # for every request of a key that sends the same salt (most send none).
        self._salted: dict[tuple[bytes, str, str], str] = {}

    def check_anywhere(self, key: str, value: object, path: str) -> None:
        """A field of `FORBIDDEN_ANYWHERE`, wherever it sits: refused unless opted in."""
        opt = FORBIDDEN_ANYWHERE[key]
        if value is not None and (opt is None or opt not in self.allowed):
            raise FieldNotAllowed(f"The field '{key}' is not allowed.", param=path)

    def check_part_type(self, ptype: str, path: str) -> None:
        """A part type of `FORBIDDEN_TYPES`: refused unless opted in."""
        if FORBIDDEN_TYPES[ptype] not in self.allowed:
            raise FieldNotAllowed(f"The content part '{ptype}' is not allowed.", param=path)

    def check_top_level(
        self, body: dict[str, Any], identity: Identity, *, creates_response: bool
    ) -> bool:
        """Checks and rewrites the top-level fields; whether the body was rewritten.
        `creates_response`: the body asks for a stored response (`POST /v1/responses`),
        which gets a request id bound to the key even when it names none (vLLM's own,
        `resp_` + a random uuid, would be readable by any key)."""
        if not creates_response and _TOP_LEVEL_CHECKED.isdisjoint(body):
            return self._cache_salt(body, identity)
        for field, opt in FORBIDDEN_TOP_LEVEL.items():
            if body.get(field) is not None and opt not in self.allowed:
                raise FieldNotAllowed(f"The field '{field}' is not allowed.", param=field)
        self._xargs(body.get("vllm_xargs"))
        self._background(body.get("background"))
        self._mcp_headers(body.get("tools"))
        changed = self._request_id(body, identity, creates_response)
        self._previous_response(body.get("previous_response_id"), identity)
        for field in NAMESPACED_TOP_LEVEL:
            changed = self._identifier(body, field, identity) or changed
        return self._cache_salt(body, identity) or changed

    def _xargs(self, xargs: object) -> None:
        if xargs is None:
            return
        if not isinstance(xargs, dict):
            raise InvalidRequest("vllm_xargs must be an object.", param="vllm_xargs")
        allowed = self.xargs_keys
        for key in xargs:
            if key not in allowed:
                raise FieldNotAllowed(
                    "This vllm_xargs key is not allowed.", param=f"vllm_xargs.{key}"[:200]
                )

    def _background(self, value: object) -> None:
        """vLLM 0.32 answers a `background` Responses request at once (`queued`) and
        generates on: the key's in-flight cap counts the answered request, not the
        generation, and no client connection is left to abort it. Anything but
        absent, null or false (as vLLM's pydantic reads it: `0` and `"no"` are false,
        `1` and `"yes"` true) is refused."""
        if value is None or OptIn.background in self.allowed or not lax_bool(value, "background"):
            return
        raise FieldNotAllowed("The field 'background' is not allowed.", param="background")

    def _mcp_headers(self, tools: object) -> None:
        """vLLM 0.32 opens a session with the operator's `--tool-server` for each `mcp`
        tool of a Responses request and sends the tool's `headers` with it
        (entrypoints/openai/responses/context.py): a client's `headers` on any tool are
        refused unless opted in, whatever the tool's type says."""
        if not isinstance(tools, list) or OptIn.mcp_headers in self.allowed:
            return
        for i, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("headers") is not None:
                raise FieldNotAllowed(
                    "The field 'headers' of a tool is not allowed.", param=f"tools[{i}].headers"
                )

    def _request_id(self, body: dict[str, Any], identity: Identity, creates_response: bool) -> bool:
        value = body.get("request_id")
        if value is None and not creates_response:
            return False
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 128):
            raise InvalidRequest("request_id must be a short string.", param="request_id")
        body["request_id"] = identity.response_id(value)
        return True

    def _previous_response(self, value: object, identity: Identity) -> None:
        """vLLM continues from the stored response (its output and its messages) that
        `previous_response_id` names: only one this key created."""
        if value is None:
            return
        if not isinstance(value, str) or not identity.owns_response(value):
            raise ResponseNotFound(param="previous_response_id")

    def _identifier(self, body: dict[str, Any], field: str, identity: Identity) -> bool:
        """A client-chosen identifier the engine shares across keys, namespaced."""
        value = body.get(field)
        if value is None:
            return False
        if not isinstance(value, str) or not 0 < len(value) <= 128:
            raise InvalidRequest(f"{field} must be a short string.", param=field)
        body[field] = identity.namespaced(field, value)
        return True

    def _cache_salt(self, body: dict[str, Any], identity: Identity) -> bool:
        salt = body.get("cache_salt")
        if salt is not None and (
            not isinstance(salt, str) or not 0 < len(salt) <= self.max_cache_salt_length
        ):
            raise InvalidRequest("cache_salt is not a string or is too long.", param="cache_salt")
        mode = self.cache_isolation
        if mode is CacheIsolation.off:
            return False
        # The client's own salt still partitions the cache, but only within its tenant.
        tenant = mode is CacheIsolation.tenant
        memo = (identity.secret, identity.tenant if tenant else identity.owner, salt or "")
        salted = self._salted.get(memo)
        if salted is None:
            salted = identity.namespaced("cache_salt", memo[2], tenant=tenant)
            if len(self._salted) >= _SALTS_KEPT:
                self._salted.clear()
            self._salted[memo] = salted
        body["cache_salt"] = salted
        return True
