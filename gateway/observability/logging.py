"""structlog setup: one line per event, JSON or console, with secrets scrubbed.

The request line is built from fixed fields (middleware.Front); nothing a
client sends is logged except its method, path and request id. As a second line of
defence a processor masks values under secret-looking names and cuts `data:` URLs short,
so a field added later cannot leak a key or a whole image into the logs.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import sys
from typing import Any, Literal

import orjson
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

_SECRET_NAMES = re.compile(r"authorization|api_?key|token|secret|password", re.I)
_DATA_URL = re.compile(r"data:[^,\s]{0,100},[A-Za-z0-9+/=%_-]{16,}")
# The logger of python-multipart (the upload parser); its modules log under it.
_MULTIPART_LOGGER = "python_multipart"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


# Field names are few and fixed: decide once per name, not once per log line.
_secret_name: dict[str, bool] = {}


def redact(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """Mask secret-named fields; shorten data URLs in string fields."""
    for name, value in event.items():
        secret = _secret_name.get(name)
        if secret is None:
            secret = _secret_name[name] = bool(_SECRET_NAMES.search(name))
        if secret:
            event[name] = "***"
        elif isinstance(value, str) and "data:" in value:
            event[name] = _DATA_URL.sub("data:<redacted>", value)
    return event


def _orjson(logger: WrappedLogger, method: str, event: EventDict) -> bytes:
    return orjson.dumps(event, default=str)


_UTC = datetime.UTC
_JSON_LINE = orjson.OPT_UTC_Z | orjson.OPT_APPEND_NEWLINE


class RequestLog:
    """Writes the one line per request.

    In the JSON format the line is rendered here: the same fields in the same order, the
    same level and ISO UTC timestamp as the structlog pipeline of `configure_logging`
    would write. Through that pipeline (bound logger, processor chain, redaction walk,
    BytesLogger lock) the line costs ~22 us of CPU per request, 8% of the gateway's CPU
    at 64 connections (py-spy). The fields are fixed by the caller; the one that carries
    client text, the path, still goes through the data: URL redaction. In the console
    format, and for every other event, structlog is used as configured.

    Once `bind` gave it the loop, lines are flushed once per loop iteration instead of
    once per line: the write system call per line is another 8% of the CPU at 64
    connections (py-spy), and the requests finished in one iteration share one write.
    `flush()` at shutdown.
    """

    def __init__(
        self,
        logger: Any,
        fmt: Literal["json", "console"],
        level: Literal["debug", "info", "warning", "error"],
    ) -> None:
        self._logger = logger
        self._enabled = _LEVELS.get(level, logging.ERROR) <= logging.INFO
        self._direct = fmt == "json"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: Any = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def flush(self) -> None:
        out, self._pending = self._pending, None
        if out is not None:
            out.flush()

    def write(self, fields: dict[str, Any]) -> None:
        """Log `fields` as the `request` event. Only `path` may carry client text."""
        if not self._enabled:
            return
        if not self._direct:
            self._logger.info("request", **fields)
            return
        path = fields.get("path")
        if isinstance(path, str) and "data:" in path:
            fields["path"] = _DATA_URL.sub("data:<redacted>", path)
        fields["event"] = "request"
        fields["level"] = "info"
        fields["timestamp"] = datetime.datetime.now(_UTC)
        # Looked up per line, like print(): tests and daemons may swap sys.stdout.
        out = sys.stdout.buffer
        out.write(orjson.dumps(fields, default=str, option=_JSON_LINE))
        if self._loop is None:
            out.flush()
            return
        pending = self._pending
        if pending is None:
            self._loop.call_soon(self.flush)
        elif pending is not out:
            pending.flush()
        self._pending = out


def configure_logging(
    fmt: Literal["json", "console"],
    level: Literal["debug", "info", "warning", "error"],
) -> None:
    """Configure structlog for the process (uvicorn workers call it once each)."""
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        # `log.exception(...)` sets exc_info: without this the JSON line carries only
        # `"exc_info": true` and no traceback. Formatted before `redact`, so data: URLs
        # in exception text are cut short like any other field. Plain text, not
        # `dict_tracebacks`, which can render frame locals (request bodies, keys).
        processors += [structlog.processors.format_exc_info, redact, _orjson]
        factory: Any = structlog.BytesLoggerFactory(sys.stdout.buffer)
    else:
        # The console renderer prints the traceback of exc_info itself.
        processors += [redact, structlog.dev.ConsoleRenderer(colors=False)]
        factory = structlog.PrintLoggerFactory(sys.stdout)
    # python-multipart logs each malformed upload through the standard library, as a
    # plain-text line outside this format (its byte values, where parsing stopped). The
    # gateway already refuses that upload (proxy/multipart.py) and logs the refusal.
    logging.getLogger(_MULTIPART_LOGGER).setLevel(logging.CRITICAL)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.ERROR)),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
