"""Settings of engine health checks and routing (`GATEWAY_ROUTING__...`)."""

from __future__ import annotations

from enum import StrEnum
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from redis.asyncio.connection import parse_url


class RoutingPolicy(StrEnum):
    affinity = "affinity"
    round_robin = "round_robin"
    least_loaded = "least_loaded"


class RoutingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: RoutingPolicy = RoutingPolicy.affinity
    health_interval: float = Field(default=2.0, gt=0.0)
    health_timeout: float = Field(default=1.0, gt=0.0)
    # A check that times out while the engine is answering requests of this process
    # keeps it in rotation for up to this many seconds of checks in a row timing out:
    # vLLM's API server parses and validates a request body on its event loop, so one
    # large body can hold its /health answer for seconds while nothing is wrong. An
    # idle engine that times out, or one still timing out after this, is taken out;
    # except the last engine in rotation for its models: while it answered a request
    # within this many seconds (or has one in flight), slowness alone never takes it out.
    busy_grace: float = Field(default=10.0, ge=0.0)
    # A healthy engine's model list (GET /v1/models) is read again this often, at its
    # next health check: what it serves (adapters loaded or unloaded) and the gateway's
    # /v1/models answer follow within about this long (routing/models.py).
    models_interval: float = Field(default=15.0, gt=0.0)
    # `dns+http://name:port` engine entries are resolved again this often (pool.py).
    dns_interval: float = Field(default=5.0, gt=0.0)
    # Passive ejection (pool.py): an engine that refuses a connection, or fails this
    # many requests in a row (5xx, timeouts), leaves the rotation for a back-off that
    # starts at `eject_backoff` seconds and doubles with each ejection that follows
    # without a good answer in between (at most `eject_backoff_max`); it comes back
    # when a health check passes after the back-off.
    # A run ejects only when it says the engine is sick, not one request: it spans the
    # requests of `eject_keys` keys or more. One key's timeouts can be its own long
    # generations; an engine silent for everyone also fails its health checks, which
    # take it out. An engine's 501 (a route its model does not serve) never counts
    # (docs/routing.md, "Whose failure is it").
    eject_after_5xx: int = Field(default=5, ge=1)
    eject_keys: int = Field(default=2, ge=1)
    eject_backoff: float = Field(default=1.0, gt=0.0)
    eject_backoff_max: float = Field(default=30.0, gt=0.0)
    # A key whose requests fail at the engines (5xx, 501 included, and timeouts) this
    # many times in a window of `key_errors_window` seconds, aligned to the epoch, is
    # answered 429 `too_many_engine_errors` until the window ends (key_errors.py; 0: off).
    # With a store the count is shared by every process and replica.
    key_errors: int = Field(default=30, ge=0)
    key_errors_window: float = Field(default=60.0, gt=0.0)
    # Scrape each healthy engine's /metrics this often for `vllm:num_requests_running`,
    # `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (0: off). The load
    # bound and `least_loaded` then compare the engines' own running + waiting, which
    # every replica and worker process sees alike (engine.py, Engine.load).
    load_interval: float = Field(default=1.0, ge=0.0)
    # Load bound for affinity: an engine is skipped while it carries more than
    # (1 + load_epsilon) * mean + 1 requests. Generous, because a request it moves
    # leaves its conversation's cache, and replicas reading the load at other moments
    # move different ones: at 0.75 two replicas moved 11 of 174 chat follow-ups in the
    # routing bench, at 2 none (docs/routing.md, Measurements).
    load_epsilon: float = Field(default=2.0, ge=0.0)
    # Hot candidates (hotspots.py): a prefix carried by a share s of the last
    # `hot_window` to 2 * `hot_window` requests, above 1 / (hot_divisor * N), at least
    # `hot_min_count` of them, and branching, spreads its requests over a stretch of
    # the line of engines as long as its share of the hot traffic (policy.py); while
    # the hot traffic is under 1 / hot_divisor of all, hot_divisor * N * s engines.
    hot_window: int = Field(default=1024, gt=0)
    hot_divisor: float = Field(default=4.0, gt=0.0)
    hot_min_count: int = Field(default=8, ge=1)
    # Plain prompts get a candidate anchor every this many bytes of text (about 128
    # tokens, 8 of vLLM's 16-token blocks), and at most `max_candidates` per request (the shortest).
    prompt_block_bytes: int = Field(default=512, gt=0)
    max_candidates: int = Field(default=64, ge=1)
    # Optional session affinity: the proxy passes this header's value as the session
    # key; with `session_from_user` the body's `user` field is used when no header is.
    session_header: str | None = None
    session_from_user: bool = False
    # The shared placement store (store.py, docs/routing.md "The shared store") is the
    # top-level store (`store_url`, config/settings.py): with one, a new anchor goes to
    # the engine with the lowest expected load (recent requests plus the requests its
    # anchors are expected to bring, decaying with `store_decay` seconds) and every
    # replica reads that placement, kept `store_ttl` seconds after its last use.
    store_ttl: float = Field(default=900.0, gt=0.0)
    store_decay: float = Field(default=10.0, gt=0.0)
    # The anchors one key holds in the store (each anchor counts for the key that
    # placed it); past it, the key's least recently used one is deleted, so one key's
    # unique prefixes cannot displace other keys' placements (store.py).
    store_anchors_per_key: int = Field(default=10_000, ge=1)
    # Accepted aliases of the top-level `store_url`, `store_prefix`, `store_timeout`
    # and `store_retry` (their place before the store also held the limits); unset:
    # the top-level value. Set in both places to different values: a config error.
    store_url: SecretStr | None = None
    store_prefix: str | None = Field(default=None, min_length=1, max_length=128)
    store_timeout: float | None = Field(default=None, gt=0.0)
    store_retry: float | None = Field(default=None, gt=0.0)

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else check_store_url(value)


def check_store_url(value: SecretStr) -> SecretStr:
    """Raise ValueError unless `value` is a URL the store's client can use. The message
    never quotes the URL: it may carry a password."""
    try:
        parts = urlsplit(value.get_secret_value())
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ValueError("not a URL (redis://host:port or unix:///path)") from None
    if parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise ValueError("a redis:// URL needs a host (redis://host:port)")
    elif parts.scheme == "unix":
        if not parts.path:
            raise ValueError("a unix:// URL needs a socket path (unix:///path.sock)")
    else:
        raise ValueError("must start with redis://, rediss:// or unix://")
    # Its query as the store's client reads it (gateway/store/client.py), which would
    # otherwise refuse it only when the app is built: in each worker of `serve --workers N`.
    try:
        parse_url(value.get_secret_value())
    except ValueError:
        raise ValueError(
            "a query parameter of the URL has a value redis cannot read "
            "(db, socket_timeout, max_connections, ...)"
        ) from None
    return value
