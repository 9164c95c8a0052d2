"""Work a daemon thread does while a `with` block runs (a server in this process, a
sampler)."""

from __future__ import annotations

import threading
from typing import Self


class InThread:
    """Work done by a daemon thread while a `with` block runs: `run` in the thread,
    `stop` (from the caller's thread) to make it return; the block's end waits for it."""

    def __init__(self) -> None:
        self._thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._thread.join()
