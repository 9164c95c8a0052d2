"""A process and its descendants, read from /proc: who they are, their CPU time, their
resident memory, and the sockets they hold."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name sits in parentheses and may hold spaces: split after it.
    return raw[raw.rindex(")") + 2 :].split()


def _children(pid: int) -> list[int] | None:
    """`pid`'s children from its threads' `children` files (proc(5)), which read nothing
    of other processes; None where the kernel has no such files."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return None
    found: list[int] = []
    for tid in tids:
        try:
            found += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _children_by_scan() -> dict[int, list[int]]:
    """Every process's children, from each /proc/<pid>/stat's parent field."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (uvicorn workers, nginx workers). Read from the
    processes' own `children` files, not by scanning every process on the machine: the
    soak samples it every second, and a scan reads hundreds of other processes' entries
    while test suites run beside it."""
    scanned: dict[int, list[int]] | None = None
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        kids = _children(p)
        if kids is None:
            scanned = scanned if scanned is not None else _children_by_scan()
            kids = scanned.get(p, [])
        todo.extend(kids)
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` and its live descendants (utime, stime of /proc/stat)."""
    total = 0
    for p in process_tree(pid):
        fields = _stat_fields(p)
        if fields is not None:
            # Fields 14 and 15 of proc(5), counted from 1; index 11 and 12 after the name.
            total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants (VmRSS)."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def socket_inodes(pids: Iterable[int]) -> set[str]:
    """Inodes of the sockets `pids` hold open."""
    inodes = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    return inodes
