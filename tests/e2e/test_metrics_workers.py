"""/metrics of `serve --workers 2` counts what every worker answered, in one scrape, and a
restarted worker takes nothing back (observability/multiprocess.py).

A gateway before a simulated engine. Which worker answered a request or a scrape is read
from /gateway/status on the same connection (tests/procs.py `by_worker`): each request
goes on a new connection, so the kernel hands them to both workers, and the tests check
it did. Each worker copies its counts into the shared files once a second, so totals are
read once a second has passed since the last request.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.metrics import HTTP, Samples
from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import (
    Proc,
    auth,
    by_worker,
    counted_by_worker,
    every_worker_lists,
    gateway_proc,
    running,
    sim_proc,
    total,
    wait_for,
    worker_pids,
)

ALICE = "sk-metrics-workers-alice-0123456789"
BOB = "sk-metrics-workers-bob-0123456789"
ADMIN = "sk-metrics-workers-admin-0123456789"
SCRAPER = "sk-metrics-workers-scraper-0123456789"
KEYS = [
    {"key": ALICE, "name": "alice"},
    {"key": BOB, "name": "bob"},
    {"key": ADMIN, "name": "ops", "scopes": ["admin"]},
    {"key": SCRAPER, "name": "scraper", "scopes": ["metrics"]},
]
# A worker's start imports the whole gateway: 18 s was seen on a loaded machine.
RESTART = 90.0


@dataclass
class Stack:
    gateway: Proc
    # The gateway's temporary directory (its TMPDIR): where `serve` makes the workers'.
    tmp: Path


@contextmanager
def start(tmp_path: Path, workers: int) -> Iterator[Stack]:
    sim = sim_proc(tmp_path, "--latency", "zero")
    tmp = tmp_path / "gateway-tmp"
    tmp.mkdir()
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps(KEYS),
        "TMPDIR": str(tmp),
    }
    gateway = gateway_proc(tmp_path, env, "--workers", str(workers))
    with running(sim), running(gateway, ready_path="/healthz"):
        ready = wait_for(lambda: every_worker_lists(gateway, workers, MODEL, auth(ALICE)), 60)
        assert ready, gateway.log_tail()
        yield Stack(gateway, tmp)


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Stack]:
    with start(tmp_path, 2) as stack:
        yield stack


@pytest.fixture
def one(tmp_path: Path) -> Iterator[Stack]:
    with start(tmp_path, 1) as stack:
        yield stack


def chat(key: str, words: int) -> Any:
    def call(client: httpx.Client) -> dict[str, int]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "word " * words}],
            "max_tokens": 3,
        }
        r = client.post("/v1/chat/completions", json=body, headers=auth(key))
        assert r.status_code == 200, r.text
        usage: dict[str, int] = r.json()["usage"]
        return usage

    return call


def send(stack: Stack, count: int) -> tuple[set[int], dict[str, list[int]]]:
    """`count` chats, alice's and bob's in turn (bob's prompts longer): the workers that
    answered them, and each key's prompt and completion tokens as the answers said."""
    pids: set[int] = set()
    tokens = {"alice": [0, 0], "bob": [0, 0]}
    for i in range(count):
        key, name = (ALICE, "alice") if i % 2 else (BOB, "bob")
        [(pid, usage)] = by_worker(stack.gateway.url, ADMIN, chat(key, 3 + 5 * (name == "bob")), 1)
        pids.add(pid)
        tokens[name][0] += usage["prompt_tokens"]
        tokens[name][1] += usage["completion_tokens"]
    return pids, tokens


def chats(samples: Samples) -> float:
    return total(samples, "gateway_requests_total", group="inference", status="200")


def scrapes(stack: Stack, at_least: int, workers: int) -> list[tuple[int, Samples]]:
    """At least `at_least` scrapes, more until `workers` workers answered some (40 at most)."""
    seen = counted_by_worker(stack.gateway.url, ADMIN, at_least, auth(SCRAPER))
    while len({pid for pid, _ in seen}) < workers and len(seen) < 40:
        seen += counted_by_worker(stack.gateway.url, ADMIN, 1, auth(SCRAPER))
    return seen


def settled(stack: Stack, requests: int) -> bool:
    """Whether a scrape counts `requests` chats: each worker has copied its counts."""
    [(_, samples)] = counted_by_worker(stack.gateway.url, ADMIN, 1, auth(SCRAPER))
    return chats(samples) == requests


def metric_files(stack: Stack) -> list[str]:
    [directory] = stack.tmp.glob("vllm-gateway-metrics-*")
    return sorted(p.name for p in directory.glob("*.db"))


def serving(stack: Stack, pid: int) -> bool:
    """Whether worker `pid` answers: one of ten new connections reaches it."""
    return any(p == pid for p, _ in by_worker(stack.gateway.url, ADMIN, lambda c: None, 10))


def restarted(stack: Stack, before: set[int]) -> int | None:
    """The worker started in place of one of `before`, once it answers."""
    new = worker_pids(stack.gateway) - before
    if len(new) != 1:
        return None
    [pid] = new
    return pid if serving(stack, pid) else None


@pytest.mark.slow
def test_every_scrape_counts_every_worker(two: Stack) -> None:
    workers, tokens = send(two, 24)
    # Both workers answered chats: else one registry alone would read 24.
    assert len(workers) == 2, workers
    assert wait_for(lambda: settled(two, 24), 30)
    seen = scrapes(two, 8, 2)
    assert {pid for pid, _ in seen} == workers
    for pid, samples in seen:
        assert chats(samples) == 24, pid
        for name, (prompt, completion) in tokens.items():
            assert total(samples, "gateway_prompt_tokens_total", key=name) == prompt, name
            assert total(samples, "gateway_completion_tokens_total", key=name) == completion
        durations = total(samples, "gateway_request_duration_seconds_count", group="inference")
        assert durations == 24
        # Every gauge once, whichever worker answered.
        assert total(samples, "gateway_engine_healthy") == 1.0
    # The status says it answers for one of them.
    r = HTTP.get(two.gateway.url + "/gateway/status", headers=auth(ADMIN))
    process = r.json()["process"]
    assert process["workers"] == 2 and process["view"] == "this_process"
    assert process["pid"] in workers


@pytest.mark.slow
def test_a_restarted_worker_takes_no_count_back(two: Stack) -> None:
    workers, _ = send(two, 24)
    assert len(workers) == 2 and worker_pids(two.gateway) == workers
    assert wait_for(lambda: settled(two, 24), 30)
    directory = next(two.tmp.glob("vllm-gateway-metrics-*"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    first, second = sorted(workers)
    # Ended as an orchestrator ends it: its last copy at shutdown. uvicorn starts another.
    os.kill(first, signal.SIGTERM)
    assert wait_for(lambda: restarted(two, workers) is not None, RESTART), two.gateway.log_tail()
    for _, samples in scrapes(two, 8, 2):
        assert chats(samples) == 24
    send(two, 6)
    assert wait_for(lambda: settled(two, 30), 30)
    # Killed outright, after its counts were copied: they stay; its gauges leave.
    before = worker_pids(two.gateway)
    os.kill(second, signal.SIGKILL)
    assert wait_for(lambda: restarted(two, before) is not None, RESTART), two.gateway.log_tail()
    live = worker_pids(two.gateway)
    seen = scrapes(two, 8, 2)
    assert {pid for pid, _ in seen} == live
    for _, samples in seen:
        assert chats(samples) == 30
        assert total(samples, "gateway_engine_healthy") == 1.0
    names = metric_files(two)
    gauge_pids = {n.rpartition("_")[2].removesuffix(".db") for n in names if n.startswith("gauge_")}
    assert gauge_pids == {str(pid) for pid in live}
    # The ended workers' counts stay in their files.
    assert {f"counter_{first}.db", f"counter_{second}.db"} <= set(names)


@pytest.mark.slow
def test_one_worker_serves_its_own_metrics_and_writes_no_files(one: Stack) -> None:
    workers, tokens = send(one, 6)
    assert workers == {one.gateway.pid}
    [(pid, samples)] = counted_by_worker(one.gateway.url, ADMIN, 1, auth(SCRAPER))
    assert pid == one.gateway.pid
    assert chats(samples) == 6
    assert total(samples, "gateway_prompt_tokens_total", key="bob") == tokens["bob"][0]
    r = HTTP.get(one.gateway.url + "/gateway/status", headers=auth(ADMIN))
    assert r.json()["process"] == {"pid": one.gateway.pid, "workers": 1, "view": "this_process"}
    assert list(one.tmp.iterdir()) == []


@pytest.mark.slow
def test_the_workers_directory_goes_with_the_gateway(tmp_path: Path) -> None:
    with start(tmp_path, 2) as stack:
        send(stack, 2)
        assert len(list(stack.tmp.glob("vllm-gateway-metrics-*"))) == 1
    assert list(stack.tmp.iterdir()) == []
