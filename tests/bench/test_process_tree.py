"""bench/harness/process_tree.py: a process and its descendants, read from the kernel's
`children` files, agree with a scan of every process's parent."""

from __future__ import annotations

import subprocess
import time

import pytest

from bench.harness.process_tree import _children_by_scan, cpu_seconds, process_tree
from bench.harness.server import terminate


def _scanned_tree(pid: int) -> list[int]:
    children = _children_by_scan()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


@pytest.mark.slow
def test_the_tree_holds_children_and_grandchildren() -> None:
    # A shell with two children, one of which has its own child.
    script = "sleep 30 & (sleep 30 & wait) & wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(proc.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(proc.pid)
        assert tree[0] == proc.pid
        assert len(tree) == 4, tree
        assert sorted(tree) == sorted(_scanned_tree(proc.pid))
        assert cpu_seconds(proc.pid) >= 0
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        proc.wait(5)


def test_a_process_that_is_gone_is_its_own_tree() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait(5)
    assert process_tree(proc.pid) == [proc.pid]


@pytest.mark.slow
def test_terminate_kills_the_whole_tree_of_a_child_that_ignores_sigterm() -> None:
    """A supervisor that does not leave on SIGTERM is killed with everything under it,
    not alone (its workers would run on, orphaned)."""
    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = process_tree(proc.pid)[1]
        terminate(proc, grace=0.5)
        assert proc.returncode is not None
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        proc.wait(5)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (an orphan is reaped by init; a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
