"""The serving process's own tuning: the allocator, the open-files limit, the collector.

* `tune_allocator()`: give large freed blocks back to the system (glibc only);
  `trim_periodically()`: and the free memory left in the arenas, every few seconds.
* `raise_fd_limit()`: the soft open-files limit up to the hard one; `fd_limit()`: the
  limit in force, which the connection limits are fitted to (gateway/server/limits.py).
* `tune_collector()`: the cyclic collector's thresholds, and what exists at start frozen.

The allocator. glibc serves an allocation above its mmap threshold with its own mmap and
unmaps it when freed; below, from an arena, which keeps freed memory. The threshold
starts at 128 KiB and rises to the size of any mmapped block that is freed (up to 32
MiB), so once one image buffer is freed, later ones (Pillow allocates them in blocks of
up to 16 MiB) come from arenas and stay there: after two requests of eight 6324 x 6324
RGBA PNGs the gateway keeps 989 of its 990 MiB peak (bench/suites/decode_memory.py). A
fixed threshold turns the rise off (on the decode-heavy pair at default settings, 65 MiB
kept of a 192 MiB peak against 161 of 193: docs/facts.md, "Process memory"):

- The mmap threshold is fixed at 4 MiB: the buffers of a 1 MB image (its 1.3 MB body,
  the ASCII copy of its base64, the decoded bytes, Pillow's pixels) stay under it and
  are reused from the arenas (327 minor page faults a round for that image's path in
  process, 1,886 at 1 MiB). Images of over a million pixels still take fresh mappings,
  given back as they are freed.
- The trim threshold is fixed at 8 MiB: fixing the mmap threshold also fixes the trim
  threshold, at its 128 KiB start, so the free top of each heap would be given back
  after every request and faulted in again on the next.
- Pillow's own block cache is off by default (`PIL.Image.core.get_blocks_max()` is 0)
  and is left off.

What stays below the threshold still piles up in the arenas: request bodies arrive in
chunks of up to 64 KiB, and twelve chunked bodies over the 32 MiB cap at once leave the
gateway at 166 MiB of RSS, from 60, for good; `malloc_trim(0)` takes it back to 60. The
gateway calls it every `TRIM_INTERVAL` seconds: one call walks the arenas and returns
their free pages, 5.4 ms with ~106 MiB to give back and about a microsecond with
nothing (in process, this machine).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import platform
import resource
from collections.abc import Callable

import structlog

log = structlog.get_logger("gateway.server.process")

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 * 1024 * 1024
TRIM_THRESHOLD = 8 * 1024 * 1024
TRIM_INTERVAL = 10.0
# Young-generation threshold of the cyclic collector. Python's default (700) ran a gen-0
# collection every few requests at 64 connections: 1,552 of them in one 12 s run, 8-9%
# of the gateway's CPU (py-spy, gc.callbacks). At 20,000 the same run made 5.
GC_THRESHOLDS = (20_000, 10, 10)
# What an unlimited RLIMIT_NOFILE stops at: the kernel's nr_open (2**20 by default).
NR_OPEN = 1 << 20


def tune_allocator(threshold: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes and its trim threshold at `trim`;
    False (and nothing done) on any other C library, or when the operator set
    MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ themselves."""
    if (
        platform.libc_ver()[0] != "glibc"
        or {
            "MALLOC_MMAP_THRESHOLD_",
            "MALLOC_TRIM_THRESHOLD_",
        }
        & os.environ.keys()
    ):
        return False
    done = True
    for parameter, name, value in (
        (M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", threshold),
        (M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", trim),
    ):
        try:
            ok = bool(ctypes.CDLL("libc.so.6").mallopt(parameter, value))
        except (OSError, AttributeError):
            ok = False
        if not ok:
            log.warning("mallopt_failed", parameter=name)
            done = False
    return done


def malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None on any other C library."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim: Callable[[int], object] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: trim(0)


async def trim_periodically(interval: float = TRIM_INTERVAL) -> None:
    """Give the arenas' free pages back every `interval` seconds, until cancelled; on
    a C library other than glibc, nothing."""
    trim = malloc_trim()
    if trim is None:
        return
    while True:
        await asyncio.sleep(interval)
        trim()


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it);
    return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, NR_OPEN)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return soft


def fd_limit() -> int:
    """This process's soft RLIMIT_NOFILE (an unlimited one counts as `NR_OPEN`)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return NR_OPEN if soft == resource.RLIM_INFINITY else soft


def tune_collector() -> None:
    """Collector settings for a serving process; called once the app is built.

    The objects that exist by then (modules, settings, tables) live as long as the
    process: frozen, later collections do not walk them again.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
