"""The front ends a live run compares: gateways with each policy, vllm-router, replicas."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from bench.harness.redis_server import redis_server_path
from bench.harness.server import Server, free_port
from bench.suites.fleet import BENCH_KEY, Fleet
from bench.suites.routing.options import Options

# Starts the engines' front end(s) (stopped by the fleet or the exit stack); returns their
# URLs and the headers a client sends.
Starter = Callable[[Fleet, list[str], ExitStack], tuple[list[str], dict[str, str]]]


@dataclass
class Front:
    name: str
    start: Starter | None
    ideal: bool = False
    # The policy (or router) it runs, and how many replicas take the requests in turn.
    family: str = ""
    replicas: int = 1


def _gateway(policy: str, replicas: int, opts: Options, store: bool = False) -> Starter:
    def start(
        fleet: Fleet, engines: list[str], stack: ExitStack
    ) -> tuple[list[str], dict[str, str]]:
        env = {"GATEWAY_ROUTING__POLICY": policy, "GATEWAY_LOG_LEVEL": "warning"}
        if opts.load_epsilon is not None:
            env["GATEWAY_ROUTING__LOAD_EPSILON"] = str(opts.load_epsilon)
        if store:
            # A fresh, empty store for every row, like the fresh engines.
            env["GATEWAY_ROUTING__STORE_URL"] = fleet.redis().url
        env.update(opts.gateway_env)
        name = f"gateway-{policy}{'-store' if store else ''}"
        urls = [fleet.gateway(engines, env, name=f"{name}-{i}").url for i in range(replicas)]
        return urls, {"Authorization": f"Bearer {BENCH_KEY}"}

    return start


def _router(replicas: int) -> Starter:
    def start(
        fleet: Fleet, engines: list[str], stack: ExitStack
    ) -> tuple[list[str], dict[str, str]]:
        urls = []
        for i in range(replicas):
            port = free_port()
            # Each replica needs its own metrics port: the default (29000) is shared.
            args = [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1"]
            args += ["--port", str(port), "--policy", "cache_aware", "--log-level", "warning"]
            args += ["--prometheus-port", str(free_port()), "--worker-urls", *engines]
            log = fleet.workdir / f"vllm-router-{i}-{port}.log"
            server = Server(f"vllm-router-{i}", args, port, log, cpus=fleet.cpus.proxy)
            server.start(timeout=60.0)
            stack.callback(server.stop)
            urls.append(server.url)
        return urls, {}

    return start


def router_installed() -> bool:
    return (Path(sys.executable).parent / "vllm-router").exists()


STORE = "affinity + store"
FAMILIES = ("affinity", STORE, "round_robin", "least_loaded", "vllm-router cache_aware")


def front_name(family: str, replicas: int) -> str:
    return family if replicas == 1 else f"{family}, {replicas} replicas"


def fronts(opts: Options) -> list[Front]:
    """The ideal engine, then every family with 1, 2 and 4 replicas (`opts.replicas`):
    affinity with the shared store with `--store`, vllm-router when it is installed."""
    table = [Front("ideal (1 engine, all the cache)", None, ideal=True)]
    for replicas in opts.replicas:
        for family in FAMILIES:
            if family.startswith("vllm-router"):
                start = _router(replicas)
            elif family == STORE:
                start = _gateway("affinity", replicas, opts, store=True)
            else:
                start = _gateway(family, replicas, opts)
            table.append(Front(front_name(family, replicas), start, False, family, replicas))
    if not router_installed():
        table = [f for f in table if not f.name.startswith("vllm-router")]
    if not opts.store:
        table = [f for f in table if f.family != STORE]
    elif redis_server_path() is None:
        raise SystemExit("--store needs redis-server (apt-get install redis-server)")
    if opts.fronts:
        table = [f for f in table if any(f.name.startswith(n) for n in opts.fronts)]
    return table
