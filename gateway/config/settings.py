"""Typed settings: environment (`GATEWAY_...`, `__` for nesting), then an optional YAML file.

Precedence, highest first: values passed to `load_settings`, environment variables,
the YAML file, defaults. Secrets are `SecretStr`, so they never show in a repr or a log.

Strict at every depth: every model refuses keys it does not declare, `load_settings`
refuses `GATEWAY_*` variables that name no setting, and each value is checked here with
the code that later uses it (engine URLs, keys, the key file, media rules), so settings
that load are settings `serve` starts with (gateway/config/sources.py explains the mistakes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway.access.clients import parse_networks
from gateway.config.key_file import ApiKeyConfig, RateLimit, build_keys, load_key_file
from gateway.config.sources import Sources, YamlFile, check_environment, explain, read_yaml
from gateway.config.tls import check_ca_file, check_server_files
from gateway.media.settings import MediaSettings
from gateway.payload.settings import PayloadSettings
from gateway.proxy.headers import forwardable
from gateway.routing.dns import DnsEntry, is_dns_entry
from gateway.routing.settings import RoutingSettings, check_store_url
from gateway.upstream.origin import Origin

# The schemes an engine entry may have: a URL, or a DNS name resolved to every address.
ENGINE_SCHEMES = ("http", "https", "dns+http", "dns+https")


# What a shared limit does while the store is down: the per-process limit, or refuse.
StoreDown = Literal["local", "refuse"]

# The store's settings that `routing` also accepts, under their old names.
STORE_ALIASES = ("store_url", "store_prefix", "store_timeout", "store_retry")


class LimitsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    # Requests whose body is in, across all keys (503 overloaded beyond).
    max_in_flight: int = Field(default=1024, gt=0)
    # Requests of one key from authentication on, its body still arriving included (429
    # rate_limited beyond). A quarter of max_in_flight: one key cannot take the gateway
    # alone, and a key's slow uploads cannot hold unbounded connections.
    max_in_flight_per_key: int = Field(default=256, gt=0)
    # Requests per second with a burst, for every key without its own `rate`; None: off.
    rate_per_key: RateLimit | None = None
    # Engine sequences one request may make the engine run (prompts x `n`, batch
    # conversations, inputs; gateway/payload/sequences.py), 400 `too_many_sequences`
    # beyond. 256: vLLM 0.32's default `max_num_seqs` on most GPUs (2x its CPU default)
    # and `max_in_flight_per_key`: one request may fill a default engine's running batch
    # once, never queue thousands (vLLM takes `n` up to 16,384 and batches unbounded).
    max_sequences_per_request: int = Field(default=256, gt=0)
    max_upload_bytes: int = Field(default=25 * 1024 * 1024, gt=0)
    # Array elements and object members of a JSON body over 4 MiB (413 beyond; smaller
    # bodies are not counted: ~160 MiB parsed at most). Parsed, a value costs up to ~180
    # bytes: 32 MiB of `[],` are 11 million lists, 1 GiB and seconds of the event loop;
    # at this cap a body parses into at most ~180 MiB, in ~0.3 s (gateway/proxy/body.py
    # parse_json).
    max_json_values: int = Field(default=2_000_000, gt=0)
    # Bytes request bodies hold in memory in this process, from each body's first byte
    # until the engine has it: the raw bytes, the parsed object (measured or bounded,
    # gateway/proxy/footprint.py) and the body rewritten after media inlining
    # (503 overloaded beyond; gateway/proxy/budget.py). One key's 16 requests of 30 MiB
    # held by a slow engine took the gateway past 1 GiB without it. With the media decode
    # budget (~450 MiB at worst) and ~75 MiB idle, fits a 1 GiB container with margin.
    max_buffered_body_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    # The same for one key (429 too_many_body_bytes beyond; a request that alone would
    # hold more: 413). Half the total: one key cannot hold every body the gateway
    # takes, and a 32 MiB body (raw and parsed, ~64 MiB for text) fits with room.
    max_buffered_body_bytes_per_key: int = Field(default=128 * 1024 * 1024, gt=0)
    # Header fields per request (431 beyond). uvicorn caps neither their number (httptools)
    # nor, with httptools, their total size; every header loop on the way is linear in it.
    max_headers: int = Field(default=100, gt=0)
    # Bytes of a request head (request line and header lines), 431 `headers_too_large`
    # beyond (gateway/server/protocol.py). httptools buffers a header value whole before handing
    # it over, at any size: uvicorn alone accepts a 2 MB head.
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    # Open client connections per process; beyond it a new connection is closed at once
    # (gateway/server/protocol.py). Each holds a file descriptor, as does each in-flight request's
    # engine connection: lowered at start to fit RLIMIT_NOFILE (gateway/server/limits.py).
    max_connections: int = Field(default=4096, gt=0)
    # Slowest average a request body may arrive at once `timeouts.request_body_grace` has
    # passed, in bytes per second (408 `request_timeout` below it); 0: no minimum.
    min_body_rate: int = Field(default=16 * 1024, ge=0)
    # Failed authentications (a wrong key, or none where one is needed) per client
    # address in `auth_failure_window` seconds; past it, 429 `too_many_failures` until the
    # window ends (gateway/access/throttle.py). 0: not throttled.
    auth_failures: int = Field(default=20, ge=0)
    auth_failure_window: float = Field(default=60.0, gt=0)
    # With a store (`store_url`), what a key's shared rate limit and shared in-flight cap
    # do while the store is down or slow (gateway/store/limits.py): `local`, the
    # per-process limit of a gateway without a store; `refuse`, 503 `limits_unavailable`.
    # `local` by default: a store outage must not take the API down, and the
    # per-process limits still bound each process.
    rate_when_store_down: StoreDown = "local"
    in_flight_when_store_down: StoreDown = "local"


class TimeoutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # --- client side (gateway/server/protocol.py, gateway/proxy/body.py) ---
    # Time a client has to send a request's head (request line and headers): from the
    # connection's opening, and on a keep-alive connection from the end of the previous
    # response. Beyond it the connection is closed without an answer (slowloris).
    request_head: float = Field(default=10.0, gt=0)
    # An idle keep-alive connection is closed after this (gateway/server/protocol.py; in place of
    # uvicorn's timeout_keep_alive, whose timer is armed per request).
    client_keepalive: float = Field(default=5.0, gt=0)
    # Time a client has to send a whole request body, from when the gateway starts
    # reading it; 408 `request_timeout` beyond.
    request_body: float = Field(default=60.0, gt=0)
    # From this long into the body on, it must have arrived at `limits.min_body_rate`
    # on average (counted from the end of the grace): a body that stalls is cut then.
    request_body_grace: float = Field(default=5.0, gt=0)
    # Longest a response may wait on a client that does not read it (the connection's
    # write buffer full); beyond it the connection is dropped, and the engine's request
    # with it: an unread stream would hold its slot and the engine's KV blocks forever.
    response_stall: float = Field(default=60.0, gt=0)
    # --- engine side ---
    connect: float = Field(default=3.0, gt=0)
    # Time allowed for the engine to start answering. Long: a queued engine is slow, not dead.
    first_byte: float = Field(default=600.0, gt=0)
    # Longest silence between two chunks of a response.
    idle: float = Field(default=300.0, gt=0)
    # How long a stream whose client left (or was dropped for not reading it) is still
    # read, unrelayed, for the token counts the engine already sent (proxy/relay.py).
    left_grace: float = Field(default=1.0, gt=0, le=30.0)
    # vLLM closes idle keep-alive connections after 5 s (docs/vllm.md, "Wire details");
    # stay below it so the gateway never writes a request onto a connection the engine
    # is closing.
    upstream_keepalive: float = Field(default=4.0, gt=0, lt=5.0)


def check_engine(entry: str) -> str:
    """Raise ValueError unless `entry` is an engine the pool can use (the same parsers)."""
    scheme, sep, _ = entry.partition("://")
    if not sep or scheme.lower() not in ENGINE_SCHEMES:
        raise ValueError(
            "an engine needs a scheme: http://, https://, dns+http:// or dns+https:// "
            "(e.g. http://127.0.0.1:8000)"
        )
    # Neither is ever sent (the engine's key is `upstream_api_key`), and the URL labels
    # log lines and metrics: a password in it would be published there.
    parts = urlsplit(entry)
    if "@" in parts.netloc:
        raise ValueError(
            "an engine URL may not carry a user name or password; "
            "the engine's key is upstream_api_key"
        )
    if parts.query or parts.fragment or "?" in entry or "#" in entry:
        raise ValueError("an engine URL may not carry a query or a fragment")
    # The OpenAI clients' `base_url` habit: the gateway adds each route's /v1/... to the
    # engine URL, so with /v1 in it every request (and every health check's model list)
    # would go to /v1/v1/... and be answered 404. A path of its own (an engine behind a
    # proxy's prefix) is kept.
    if "v1" in [segment.lower() for segment in parts.path.split("/")]:
        raise ValueError(
            "an engine URL is the engine's base URL, without /v1 (the gateway adds "
            "/v1/... to it): did you mean the base URL without /v1, such as "
            "http://127.0.0.1:8000?"
        )
    if is_dns_entry(entry):
        # The origin each resolved address becomes (the pool builds it per address).
        dns = DnsEntry(entry)
        Origin(dns.url("192.0.2.1"), dns.host)
    else:
        Origin(entry.rstrip("/"))
    return entry


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # TLS for the gateway's own clients: a PEM certificate chain and its unencrypted
    # private key, both or neither (gateway/config/tls.py); none: plain HTTP, for a
    # gateway behind an Ingress or a mesh that terminates TLS (deploy/README.md).
    ssl_certfile: FilePath | None = None
    ssl_keyfile: FilePath | None = None
    # Each checked by the parsers the pool uses (`check_engine`).
    engines: list[Annotated[str, AfterValidator(check_engine)]] = Field(default_factory=list)
    # The CA (PEM) that signs engines' certificates, for https:// and dns+https://
    # engines; None: the system's trust store. Forwarding and health checks alike.
    engine_ca_file: FilePath | None = None
    # Plain keys are SecretStr, like every secret: never in a repr, a dump or a log.
    api_keys: list[SecretStr | ApiKeyConfig] = Field(default_factory=list)
    api_keys_file: Path | None = None
    upstream_api_key: SecretStr | None = None
    # Models served besides those the engines list on /v1/models.
    served_models: list[str] = Field(default_factory=list)
    # Serve without client keys. Only for local experiments; never in production.
    allow_unauthenticated: bool = False
    # Serve the gateway's own /metrics without a key (for scrapers inside the pod).
    public_metrics: bool = False
    # Request headers forwarded to engines besides the fixed allowlist, e.g. tracing's
    # [traceparent, tracestate]; names vLLM acts on are refused (gateway/proxy/headers.py).
    forward_headers: list[str] = Field(default_factory=list)
    # Networks of the proxies in front of the gateway (an Ingress, a load balancer),
    # whose X-Forwarded-For names the client (gateway/access/clients.py); empty: the
    # client is the TCP peer and X-Forwarded-For is ignored.
    trusted_proxies: list[str] = Field(default_factory=list)
    log_format: Literal["json", "console"] = "json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    media: MediaSettings = Field(default_factory=MediaSettings)
    payload: PayloadSettings = Field(default_factory=PayloadSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    # The shared store (gateway/store/, docs/gateway.md "The shared store"):
    # `redis://[:password@]host:port/db`, `rediss://...` (TLS) or `unix:///path.sock`.
    # Unset: placements are stateless and every limit is per process. Set: anchor
    # placements, and the rate limits and own in-flight caps of keys that have them,
    # are shared by every worker and replica, under keys that start with `store_prefix`.
    # A store slower than `store_timeout` or failing is left alone for `store_retry`
    # seconds. `routing.store_*` are accepted aliases of these four.
    store_url: SecretStr | None = None
    store_prefix: str = Field(default="vllm-gateway", min_length=1, max_length=128)
    store_timeout: float = Field(default=0.2, gt=0.0)
    store_retry: float = Field(default=1.0, gt=0.0)

    @field_validator("forward_headers")
    @classmethod
    def _check_forward_headers(cls, names: list[str]) -> list[str]:
        return forwardable(names)

    @field_validator("trusted_proxies")
    @classmethod
    def _check_trusted_proxies(cls, entries: list[str]) -> list[str]:
        for index, entry in enumerate(entries):
            try:
                parse_networks([entry])
            except ValueError:
                raise ValueError(
                    f"entry {index} is not a network such as 10.0.0.0/8, fd00::/8 or "
                    "10.0.0.7/32 (no host bits set)"
                ) from None
        return entries

    @field_validator("engine_ca_file")
    @classmethod
    def _check_engine_ca(cls, path: Path | None) -> Path | None:
        return check_ca_file(path)

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, entries: list[SecretStr | ApiKeyConfig]) -> list[SecretStr | ApiKeyConfig]:
        build_keys(entries)
        return entries

    @field_validator("api_keys_file")
    @classmethod
    def _check_key_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            load_key_file(path)
        return path

    @field_validator("store_url")
    @classmethod
    def _check_store_url(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else check_store_url(value)

    @model_validator(mode="after")
    def _store_aliases(self) -> Settings:
        """`routing.store_*` fill the top-level settings they are old names of; both set
        to different values is refused, naming both."""
        for name in STORE_ALIASES:
            alias = getattr(self.routing, name)
            if alias is None:
                continue
            if name in self.model_fields_set and getattr(self, name) != alias:
                raise ValueError(
                    f"{name} and routing.{name} are both set, to different values: set "
                    f"{name} only (routing.{name} is its older name)"
                )
            setattr(self, name, alias)
        return self

    @model_validator(mode="after")
    def _check_server_tls(self) -> Settings:
        check_server_files(self.ssl_certfile, self.ssl_keyfile)
        return self

    @model_validator(mode="after")
    def _require_keys(self) -> Settings:
        if not (self.api_keys or self.api_keys_file or self.allow_unauthenticated):
            raise ValueError(
                "no API keys configured: set GATEWAY_API_KEYS or GATEWAY_API_KEYS_FILE "
                "(or GATEWAY_ALLOW_UNAUTHENTICATED=true for a local experiment)"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, *cls._file_sources(settings_cls))

    @classmethod
    def _file_sources(
        cls, settings_cls: type[BaseSettings]
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The YAML file's source, below the options and the environment: none here; the
        subclass `load_settings` builds for a file returns it."""
        return ()


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from overrides, the environment and, if given, a YAML file.

    Raises ConfigError (a ValueError) with one line per mistake, naming its source:
    `file:line`, the variable, or the override as a command-line option (`--port`)."""
    env = os.environ
    check_environment(Settings, env)
    file = read_yaml(config_file) if config_file is not None else None
    sources = Sources({name: "--" + name.replace("_", "-") for name in overrides}, env, file)
    try:
        if file is None:
            return Settings(**overrides)
        return _from_file(file)(**overrides)
    except ValidationError as exc:
        raise explain(exc, Settings, sources) from None


def _from_file(file: YamlFile) -> type[Settings]:
    data = file.data

    class _FileSource(PydanticBaseSettingsSource):
        def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
            return data.get(field_name), field_name, False

        def __call__(self) -> dict[str, Any]:
            return dict(data)

    class _FileSettings(Settings):
        @classmethod
        def _file_sources(
            cls, settings_cls: type[BaseSettings]
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (_FileSource(settings_cls),)

    return _FileSettings
