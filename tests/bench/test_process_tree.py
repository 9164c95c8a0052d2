"""bench.stack.process_tree: a process and its descendants, read from the kernel's
`children` files, agree with a scan of every process's parent."""

from __future__ import annotations

import subprocess
import time

from bench.stack import _children_by_scan, cpu_seconds, process_tree


def _scanned_tree(pid: int) -> list[int]:
    children = _children_by_scan()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


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
