"""The one builder of TLS client contexts: engines (`engine_ca_file`) and media origins
(`media.ca_file`) alike, checked with the same call when the settings load."""

from __future__ import annotations

import ssl
from pathlib import Path


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
