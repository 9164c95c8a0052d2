"""`vllm-gateway`: serve, check-config, hash-key."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from gateway.app import CONFIG_ENV, create_app, tune_collector
from gateway.auth import KeyConfigError, build_keys, hash_key, load_key_file
from gateway.config import Settings, load_settings
from gateway.connections import raise_fd_limit
from gateway.logging import configure_logging


class ConfigError(Exception):
    """Settings that cannot be used; the message is safe to print (no values)."""


def _describe(exc: ValidationError) -> str:
    # Without the inputs: a rejected value may be a key.
    lines = []
    for err in exc.errors(include_input=False, include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        lines.append(f"  {where}: {err['msg']}")
    return "invalid settings:\n" + "\n".join(lines)


def _load(config: Path | None, **overrides: Any) -> Settings:
    try:
        settings = load_settings(config, **overrides)
        # Build the keys once, so unusable keys fail here and not at the first request.
        build_keys(settings.api_keys)
        if settings.api_keys_file is not None:
            load_key_file(settings.api_keys_file)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except (KeyConfigError, ValueError) as exc:
        raise ConfigError(f"invalid settings: {exc}") from None
    return settings


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.server import GatewayProtocol

    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.log_format is not None:
        overrides["log_format"] = args.log_format
    settings = _load(args.config, **overrides)
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
    if args.workers > 1:
        # Workers build their own app from an import string: hand them the same
        # settings through the environment (they validate them again).
        if args.config is not None:
            os.environ[CONFIG_ENV] = str(args.config.resolve())
        for name, value in overrides.items():
            os.environ[f"GATEWAY_{name.upper()}"] = str(value)
        uvicorn.run("gateway.app:app_from_env", factory=True, workers=args.workers, **options)
    else:
        app = create_app(settings)
        tune_collector()
        uvicorn.run(app, **options)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    settings = _load(args.config)
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-gateway", description="A security gateway in front of vLLM engines."
    )
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", type=Path, help="YAML settings file")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=int, default=1)
    serve.add_argument("--log-format", choices=["json", "console"])
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-config", help="validate and print the effective settings")
    check.add_argument("--config", type=Path, help="YAML settings file")
    check.set_defaults(func=_check_config)
    hashk = sub.add_parser("hash-key", help="read a key on stdin, print its sha256: form")
    hashk.set_defaults(func=_hash_key)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        sys.stderr.write(f"vllm-gateway: {exc}\n")
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
