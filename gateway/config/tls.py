"""The one builder of TLS contexts: the client side for engines (`engine_ca_file`) and
media origins (`media.ca_file`), the server side for the gateway's own clients
(`ssl_certfile`, `ssl_keyfile`); each checked with the same call when the settings load."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any


def client_context(ca_file: Path | None) -> ssl.SSLContext:
    """A verifying client context trusting `ca_file`'s CAs, or the system's store."""
    return ssl.create_default_context(cafile=ca_file)


def check_ca_file(path: Path | None) -> Path | None:
    """Raise ValueError unless `path` holds CA certificates TLS can load, read as the
    gateway reads it when it starts (engine_ca_file, media.ca_file)."""
    if path is not None:
        try:
            client_context(path)
        except (ssl.SSLError, OSError):
            raise ValueError("the file holds no PEM certificate TLS can load") from None
    return path


def _no_password() -> bytes:
    # An encrypted key would otherwise make OpenSSL prompt for its password on the
    # terminal; the gateway takes none, so such a key is refused.
    raise ValueError("the key is encrypted")


def server_context(certfile: Path, keyfile: Path) -> ssl.SSLContext:
    """The context the gateway serves its clients with: Python's server defaults (TLS 1.2
    at least, its cipher list), no client certificates."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile, password=_no_password)
    return context


def server_context_factory(
    certfile: Path, keyfile: Path, config: Any, default: Any
) -> ssl.SSLContext:
    """`server_context` in the form of uvicorn's `ssl_context_factory` (bound with
    functools.partial: workers receive it pickled)."""
    return server_context(certfile, keyfile)


def check_server_files(certfile: Path | None, keyfile: Path | None) -> None:
    """Raise ValueError unless both are given and hold a certificate chain and its
    unencrypted private key, or neither is given."""
    if certfile is None and keyfile is None:
        return
    if certfile is None or keyfile is None:
        raise ValueError(
            "ssl_certfile and ssl_keyfile go together: set both (the certificate chain "
            "and its private key, PEM) or neither"
        )
    try:
        server_context(certfile, keyfile)
    except (ssl.SSLError, OSError, ValueError):
        raise ValueError(
            "ssl_certfile and ssl_keyfile: TLS cannot load them as a PEM certificate "
            "chain and its unencrypted private key (the files unreadable, not PEM, the "
            "key encrypted or not the certificate's)"
        ) from None
