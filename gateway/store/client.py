"""The one Redis client of a gateway process, shared by placement, limits and failures.

A store that fails or answers slower than `store_timeout` is left alone for
`store_retry` seconds: every caller then decides without it at once, and after that one
call at a time tries it again. A call that timed out because this process's loop was
held (its timer late by more than the timeout) goes without the store but is not the
store's failure. The change of state is logged once each way, with event
`store` and the URL without its password; the exception's class is logged, never its
text (it may quote the URL).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

import structlog
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

log = structlog.get_logger("gateway.store")

T = TypeVar("T")


def redacted(url: str) -> str:
    """The URL without its password (and user name), for logs and errors."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return f"{parts.scheme}://{netloc}{parts.path}"


class StoreClient:
    """A Redis client behind a breaker. `attempt` never raises for the store's sake:
    None means "the store is not usable now, decide without it"."""

    def __init__(self, url: str, *, prefix: str, timeout: float, retry: float) -> None:
        self.where = redacted(url)
        self.prefix = prefix
        self.timeout = timeout
        self.retry = retry
        self.redis: Redis = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            decode_responses=True,
        )
        self.up = True
        # While down: no call tries the store before this monotonic time, and only one
        # at a time after it.
        self._retry_at = 0.0
        self._probing = False

    def script(self, source: str) -> AsyncScript:
        """A Lua script run by its digest (EVALSHA), loaded on first use."""
        return self.redis.register_script(source)

    def usable(self) -> bool:
        """Whether a call may try the store now (a cheap test before building one)."""
        return self.up or (not self._probing and time.monotonic() >= self._retry_at)

    async def attempt(self, call: Callable[[], Awaitable[T]]) -> T | None:
        """`call()`'s result within `timeout`; None when the store failed, was slow or
        is being left alone. `call` must not return None itself."""
        if not self.up:
            if self._probing or time.monotonic() < self._retry_at:
                return None
            self._probing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            async with asyncio.timeout_at(deadline):
                result = await call()
        except TimeoutError as exc:
            # A timer that fires a whole timeout after its deadline says this process's
            # loop was held (a long parse of one request's body), so a reply that had
            # arrived could not be read: that call goes without the store, but the
            # store is not left alone for it.
            if loop.time() - deadline <= self.timeout:
                self._failed(exc)
            return None
        except Exception as exc:  # RedisError, OSError, a reply not as expected
            self._failed(exc)
            return None
        finally:
            self._probing = False
        if not self.up:
            self.up = True
            log.info("store", state="up", store=self.where)
        return result

    def _failed(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self.retry
        if self.up:
            self.up = False
            log.warning(
                "store",
                state="down",
                reason=type(exc).__name__,
                store=self.where,
                retry_after_s=self.retry,
            )

    async def aclose(self) -> None:
        await self.redis.aclose()
