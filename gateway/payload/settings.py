"""Settings of request-body policy beyond media (`GATEWAY_PAYLOAD__...`).

The opt-ins of fields that carry or steer media (`allow_prompt_embeds` and kin) are
media settings (`GATEWAY_MEDIA__...`, docs/media.md); everything here is about
identifiers and engine controls that a client must not choose on behalf of other
tenants.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class CacheIsolation(StrEnum):
    # Tenants share the engines' prefix caches (vLLM's default; best hit rate).
    off = "off"
    # Each key gets its own `cache_salt`: no key can time another's cached prompts.
    key = "key"
    # Keys with the same `tenant` share a salt; a key without one is its own tenant.
    tenant = "tenant"


# How deploy/ marks a value the operator must replace (its example Secrets and .env).
PLACEHOLDER_PREFIX = "REPLACE-"

# vllm_xargs keys that feed engine-level controls, never passable (vLLM 0.32:
# `EngineCoreRequest` takes these from the sampling params' extra_args).
ENGINE_XARGS = frozenset({"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"})


class PayloadSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Key of the HMAC that namespaces client-chosen identifiers (media uuids, response
    # ids, cache salts). Generated at start when unset (a `namespace_secret_generated`
    # warning): then identifiers differ across restarts and replicas, so set it, the same
    # on every replica, wherever more than one process serves the same engines.
    namespace_secret: SecretStr | None = None
    # `vllm_xargs` keys a request may set (they reach custom logits processors); the
    # field is refused while this is empty.
    vllm_xargs_keys: list[str] = Field(default_factory=list)
    # `/pooling` `data`: input for operator-installed IO-processor plugins.
    allow_pooling_data: bool = False
    # `priority` reorders the engine's queue under `--scheduling-policy priority`.
    allow_priority: bool = False
    # `background` (POST /v1/responses, with vLLM's response store on): the engine goes
    # on generating after the answer, outside the key's in-flight cap, and the client
    # leaving aborts nothing.
    allow_background: bool = False
    # `headers` of a Responses `mcp` tool: vLLM 0.32 sends them to the operator's
    # `--tool-server` with the tool session, so a client could speak to that server with
    # credentials or identities of its choosing.
    allow_mcp_headers: bool = False
    cache_isolation: CacheIsolation = CacheIsolation.off

    @field_validator("vllm_xargs_keys")
    @classmethod
    def _no_engine_controls(cls, keys: list[str]) -> list[str]:
        bad = sorted(ENGINE_XARGS.intersection(keys))
        if bad:
            raise ValueError(f"vllm_xargs_keys may not list engine controls: {bad}")
        return keys

    @field_validator("namespace_secret")
    @classmethod
    def _long_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is None:
            return None
        value = secret.get_secret_value()
        if len(value) < 16:
            raise ValueError("namespace_secret must be at least 16 characters long")
        # An example Secret applied as it is would give every deployment the same key.
        if value.startswith(PLACEHOLDER_PREFIX):
            raise ValueError(
                f"namespace_secret is still the placeholder ({PLACEHOLDER_PREFIX}...): "
                "set a random one, e.g. `python3 -c 'import secrets; "
                "print(secrets.token_hex(32))'`"
            )
        return secret
