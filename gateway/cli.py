"""`vllm-gateway`: serve, check-config, hash-key.

A configuration mistake ends the command with one line per mistake on stderr, naming
its source (`file:line`, the `GATEWAY_*` variable, or the option), and exit code 2;
never a traceback. `check-config` builds the gateway exactly as `serve` does, so a
configuration it accepts is one `serve` starts with.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import structlog
import uvicorn
from uvicorn.supervisors import Multiprocess

from gateway.app import CONFIG_ENV, Gateway, create_app, engine_states, load_keys
from gateway.config.key_file import hash_key
from gateway.config.settings import Settings, load_settings
from gateway.config.sources import ConfigError
from gateway.config.tls import server_context_factory
from gateway.observability.logging import configure_logging
from gateway.observability.multiprocess import shared_directory
from gateway.payload.inspector import generate_secret
from gateway.server.process import raise_fd_limit, tune_collector
from gateway.server.protocol import GatewayProtocol

# uvicorn's exit code when the server could not start (its lifespan failed). A port
# that cannot be bound is the gateway's own configuration error: exit code 2.
STARTUP_FAILURE = 3
# The variable each worker reads payload.namespace_secret from.
_SECRET_ENV = "GATEWAY_PAYLOAD__NAMESPACE_SECRET"  # noqa: S105 (a variable name)

ENVIRONMENT = """\
settings:
  Every setting is read, highest precedence first, from the options above, from
  GATEWAY_<NAME> environment variables (GATEWAY_<SECTION>__<NAME> for nested ones,
  e.g. GATEWAY_MEDIA__MODE=data_only; lists and objects as JSON, e.g.
  GATEWAY_ENGINES='["http://127.0.0.1:8001"]'), then from the --config file. An
  unknown GATEWAY_* variable or file key is refused. Every setting, with its default:
  deploy/gateway.example.yaml; the table: docs/gateway.md, "Settings".

  GATEWAY_ENGINES          engine URLs: http://, https://, dns+http:// or dns+https://
  GATEWAY_API_KEYS         client keys: plain (16+ characters) or sha256:<hex> digests
  GATEWAY_API_KEYS_FILE    a key file, reloaded when it changes
  GATEWAY_UPSTREAM_API_KEY the key vLLM was started with (--api-key)
  GATEWAY_SSL_CERTFILE     TLS for clients: certificate chain (PEM), with GATEWAY_SSL_KEYFILE
"""


def _build(settings: Settings) -> Gateway:
    """The gateway `serve` runs. Settings that load are checked by the code that uses
    them; should a part of the app still refuse one, that is one line here too."""
    try:
        return create_app(settings)
    except ValueError as exc:  # KeyConfigError included
        raise ConfigError(f"invalid settings: {exc}") from None


def _require_engines(settings: Settings) -> None:
    """A gateway without engines would answer every request 503: refused before it
    starts. (`dns+http://` entries that resolve to nothing yet are engines configured.)"""
    if not settings.engines:
        raise ConfigError(
            "no engines configured: set GATEWAY_ENGINES or `engines` in the config file to "
            "each vLLM engine's base URL (e.g. http://127.0.0.1:8000); without one every "
            "request is answered 503"
        )


def _listen(settings: Settings) -> socket.socket:
    """The listening socket, bound as uvicorn binds it, before anything starts: an
    address that cannot be bound is one line of the gateway's own and exit code 2, not
    uvicorn's log line after the app's start."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        where = f"{host}:{settings.port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"cannot listen on {where}: the port is in use by another process "
                "(choose another with --port, GATEWAY_PORT or `port`, or stop the other)"
            ) from None
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"cannot listen on {where}: {reason} (--host, --port)") from None
    sock.set_inheritable(True)
    return sock


def _validate(settings: Settings) -> None:
    """What building the gateway checks beyond the settings' own validation (the keys,
    the key file), without building one: for the parent of `--workers N`, which serves
    nothing itself."""
    try:
        load_keys(settings)
    except ValueError as exc:  # KeyConfigError included
        raise ConfigError(f"invalid settings: {exc}") from None


def _public(url: str) -> str:
    """An engine URL without credentials, for the log."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return parts._replace(netloc=host, query="", fragment="").geturl()


def _log_serving(
    settings: Settings, listen: Sequence[str], workers: int, app: Gateway | None = None
) -> None:
    """The start line; with the `app` that serves (one worker, its first health checks
    run), each engine's health and reason too (workers: their `gateway_started` line)."""
    structlog.get_logger("gateway.serve").info(
        "gateway_serving",
        listen=list(listen),
        engines=[_public(e) for e in settings.engines],
        policy=settings.routing.policy.value,
        media_mode=settings.media.mode.value,
        workers=workers,
        keys_file=str(settings.api_keys_file) if settings.api_keys_file else None,
        unauthenticated=settings.allow_unauthenticated,
        engine_states=None if app is None else engine_states(app.pool),
    )


def _address(sock: socket.socket, scheme: str) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}"


def _serve(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.log_format is not None:
        overrides["log_format"] = args.log_format
    if args.ssl_certfile is not None:
        overrides["ssl_certfile"] = args.ssl_certfile
    if args.ssl_keyfile is not None:
        overrides["ssl_keyfile"] = args.ssl_keyfile
    if args.workers < 1:
        raise ConfigError(f"--workers: must be at least 1, not {args.workers}")
    settings = load_settings(args.config, **overrides)
    _require_engines(settings)
    configure_logging(settings.log_format, settings.log_level)
    # Each client connection holds a descriptor: the soft limit up to the hard one
    # (workers inherit it); the app lowers max_connections to fit what remains.
    raise_fd_limit()
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        # httptools with the gateway's connection limits (keep-alive included, from
        # timeouts.client_keepalive); a class, so workers import it.
        "http": GatewayProtocol,
        "access_log": False,
        "log_level": "warning",
        "server_header": False,
        "proxy_headers": False,
        "lifespan": "on",
    }
    scheme = "http"
    if settings.ssl_certfile is not None and settings.ssl_keyfile is not None:
        # TLS under the same protocol class, so the same limits: asyncio's TLS layer
        # hands it the decrypted bytes.
        scheme = "https"
        options["ssl_context_factory"] = functools.partial(
            server_context_factory, settings.ssl_certfile, settings.ssl_keyfile
        )
    if args.workers > 1:
        # Workers build their own app from an import string: their parent checks what
        # the app would refuse before any worker starts, then hands them the same
        # settings through the environment (they validate them again).
        _validate(settings)
        sock = _listen(settings)
        if args.config is not None:
            os.environ[CONFIG_ENV] = str(args.config.resolve())
        for name, value in overrides.items():
            os.environ[f"GATEWAY_{name.upper()}"] = str(value)
        if settings.payload.namespace_secret is None:
            # One generated secret for every worker: the ids it namespaces and the
            # response ids it binds to a key must read the same on each of them. The
            # warning comes from here, once; the workers find a secret set.
            os.environ[_SECRET_ENV] = generate_secret()
        # The bound address: with port 0, the one the system chose.
        _log_serving(settings, [_address(sock, scheme)], args.workers)
        config = uvicorn.Config(
            "gateway.app:app_from_env", factory=True, workers=args.workers, **options
        )
        # The workers' metric files, merged by each scrape; removed when the parent exits.
        with shared_directory(args.workers), contextlib.suppress(KeyboardInterrupt):
            Multiprocess(config, sockets=[sock]).run()
        return 0
    sock = _listen(settings)
    app = _build(settings)
    tune_collector()

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                # The bound address: with port 0, the one the system chose.
                bound = [_address(s, scheme) for srv in self.servers for s in srv.sockets]
                # The lifespan ran first: the pool has checked every engine once.
                _log_serving(settings, bound, 1, app)

    server = Server(uvicorn.Config(app, **options))
    server.run(sockets=[sock])
    return 0 if server.started else STARTUP_FAILURE


def _check_config(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    _require_engines(settings)
    # What building the app logs (a generated secret, a lowered limit) goes to stderr:
    # stdout is the settings' JSON.
    with contextlib.redirect_stdout(sys.stderr):
        configure_logging("console", settings.log_level)
        _build(settings)
    # Every secret is typed SecretStr: the dump shows it as `**********`.
    data = settings.model_dump(mode="json")
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().rstrip("\r\n")
    if not key:
        raise ConfigError("no key on stdin")
    sys.stdout.write(hash_key(key) + "\n")
    return 0


def _settings_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
) -> argparse.ArgumentParser:
    """A command that loads the settings: it takes `--config`, and its help ends with
    the environment variables it reads."""
    command = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="YAML settings file (default: none; settings from the environment only)",
    )
    return command


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-gateway",
        description="A security gateway in front of vLLM engines.",
        epilog="`vllm-gateway <command> --help` describes each command's options.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    serve = _settings_command(
        sub,
        "serve",
        "run the gateway",
        "Run the gateway. Logs one `gateway_serving` line once it listens.",
    )
    serve.add_argument(
        "--host", help="address to listen on (default: GATEWAY_HOST, else 127.0.0.1)"
    )
    serve.add_argument(
        "--port",
        type=int,
        help="port to listen on; 0: any free port (default: GATEWAY_PORT, else 8080)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes, each with the same settings (default: 1)",
    )
    serve.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="log line format (default: GATEWAY_LOG_FORMAT, else json)",
    )
    serve.add_argument(
        "--ssl-certfile",
        type=Path,
        metavar="FILE",
        help="serve clients over TLS with this PEM certificate chain, with --ssl-keyfile "
        "(default: GATEWAY_SSL_CERTFILE, else plain HTTP)",
    )
    serve.add_argument(
        "--ssl-keyfile",
        type=Path,
        metavar="FILE",
        help="the certificate's unencrypted PEM private key (default: GATEWAY_SSL_KEYFILE)",
    )
    serve.set_defaults(func=_serve)
    check = _settings_command(
        sub,
        "check-config",
        "validate and print the effective settings",
        "Load the settings and build the gateway as `serve` would, then print the "
        "effective settings as JSON, secrets masked. Exit code 0: `serve` starts "
        "with them; 2: one line on stderr per mistake, naming its source.",
    )
    check.set_defaults(func=_check_config)
    hashk = sub.add_parser(
        "hash-key",
        help="read a key on stdin, print its sha256: form",
        description=(
            "Read one key on stdin and print its `sha256:<hex>` form, to configure in "
            "place of the plain key."
        ),
    )
    hashk.set_defaults(func=_hash_key)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            sys.stderr.write(f"vllm-gateway: {line}\n")
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
