"""The store client's breaker, in process: a call that fails leaves the store alone for
`retry` seconds; a call that timed out only because this process's loop was held (a
long parse) is answered without the store but does not take the store out for every
other request."""

from __future__ import annotations

import asyncio
import time

from gateway.store.client import StoreClient
from tests.procs import free_port


def client() -> StoreClient:
    # Nothing listens there; the calls below never use the connection.
    return StoreClient(
        f"redis://127.0.0.1:{free_port()}/0", prefix="test", timeout=0.05, retry=30.0
    )


def test_a_call_timed_out_by_a_held_loop_leaves_the_store_up() -> None:
    async def run() -> tuple[object, bool]:
        store = client()

        async def reply() -> str:
            # The reply is due long before the timeout, but the loop is held for ten
            # timeouts by other work in this process.
            asyncio.get_running_loop().call_soon(time.sleep, 0.5)
            await asyncio.sleep(0.001)
            return "ok"

        got = await store.attempt(reply)
        return got, store.up

    assert asyncio.run(run()) == (None, True)


def test_a_failing_call_takes_the_store_out_until_retry() -> None:
    async def run() -> tuple[object, bool, bool]:
        store = client()

        async def refused() -> str:
            raise ConnectionRefusedError

        got = await store.attempt(refused)
        return got, store.up, store.usable()

    assert asyncio.run(run()) == (None, False, False)
