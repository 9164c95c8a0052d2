"""deploy/k8s/routing-tier-store as processes: redis-server started with the store
manifest's arguments and the example ACL file (the password's digest in place of its
placeholder), and the tier's gateway with the overlay's environment (the store's URL
from its Secret) in front of one simulated engine per engine pod the manifests ask for.

Marked `redis` (scripts/test-store.sh): these need redis-server, and are left out of the
fast suite. The manifests themselves are checked in tests/deploy/test_routing_tier.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from bench.harness.metrics import HTTP
from bench.harness.redis_server import RedisServer, redis_server_path
from tests.deploy.manifests import STORE_PASSWORD, example_secrets, k8s_env, pod_template, render
from tests.deploy.test_routing_tier import (
    CLIENT_KEY,
    STORE,
    by_role,
    dns_entries,
    gateway_containers,
    key_file,
    named,
    redis_options,
    selects,
    sim_from_manifest,
    store_containers,
    store_users_ref,
)
from tests.procs import Proc, free_port, gateway_proc, metric, running, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

HEADERS = {"Authorization": f"Bearer {CLIENT_KEY}"}
# A key with a rate and its own cap, both held in the store, refused while it is down.
LIMITED = "sk-tier-limited-0123456789abcdef"
LIMITED_KEYS = [
    {
        "key": LIMITED,
        "name": "limited",
        "max_in_flight": 4,
        "rate": {"requests_per_second": 1000, "burst": 1000},
    }
]


def users_acl(password: str | None) -> str:
    """The example ACL file, with the digest of `password` in place of the placeholder
    (None: as shipped), as secrets.example.yaml tells the operator to make it."""
    acl = example_secrets()[store_users_ref(render(STORE))]
    if password is None:
        return acl
    digest = hashlib.sha256(password.encode()).hexdigest()
    return re.sub(r"#REPLACE-\S+", f"#{digest}", acl)


def store_args(tmp: Path, port: int, password: str | None) -> list[str]:
    """The store container's arguments, its port, users file and directory moved here."""
    ((_, c),) = store_containers(render(STORE))
    users = tmp / f"users-{port}.acl"
    users.write_text(users_acl(password))
    moved = {"port": str(port), "aclfile": str(users), "dir": str(tmp)}
    args = []
    for name, values in redis_options(c["args"]).items():
        args += [f"--{name}", *([moved[name]] if name in moved else values)]
    return args


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("routing-tier-store")


@pytest.fixture(scope="module")
def store(tmp: Path) -> Iterator[RedisServer]:
    port = free_port()
    server = RedisServer(port, tmp / "redis.log")
    # The manifest's arguments come last, so they win over RedisServer's own defaults.
    server.start(extra=store_args(tmp, port, STORE_PASSWORD))
    try:
        yield server
    finally:
        server.stop()


def gateway_user(store: RedisServer, password: str = STORE_PASSWORD) -> redis.Redis:
    return redis.Redis(port=store.port, username="gateway", password=password, socket_timeout=5)


def test_the_store_probe_answers_and_only_the_gateway_user_places(store: RedisServer) -> None:
    """The manifest's probe command gets PONG without a password; without one nothing else
    runs; the gateway user runs the placement's commands on its keys and nothing else."""
    ((_, c),) = store_containers(render(STORE))
    for probe in ("readinessProbe", "livenessProbe"):
        command = [str(store.port) if a == "6379" else a for a in c[probe]["exec"]["command"]]
        r = subprocess.run(command, capture_output=True, text=True, timeout=10)
        assert r.returncode == 0 and r.stdout.strip() == "PONG", (probe, r.stdout, r.stderr)
    anonymous = redis.Redis(port=store.port, socket_timeout=5)
    assert anonymous.ping()
    for command in (("GET", "vllm-gateway:x"), ("CONFIG", "GET", "dir"), ("FLUSHALL",)):
        with pytest.raises(NoPermissionError):
            anonymous.execute_command(*command)
    with pytest.raises(AuthenticationError):
        gateway_user(store, "not-the-password").ping()
    client = gateway_user(store)
    assert client.hset("vllm-gateway:probe", "u", "x") == 1
    assert client.hmget("vllm-gateway:probe", ["u"]) == [b"x"]
    sha = client.script_load("return redis.call('TIME')")
    assert len(client.evalsha(sha, 0)) == 2
    refused: list[tuple[str, ...]] = [
        ("HSET", "other:probe", "u", "x"),  # outside the gateways' prefix
        ("GET", "vllm-gateway:probe"),
        ("KEYS", "*"),
        ("EVAL", "return 1", "0"),
        ("CONFIG", "SET", "dir", "/tmp"),
        ("FLUSHALL",),
        ("ACL", "LIST"),
        ("MODULE", "LIST"),
        ("SLAVEOF", "127.0.0.1", "1"),
    ]
    for command in refused:
        with pytest.raises(NoPermissionError):
            client.execute_command(*command)
    # A script runs with its caller's rights: no way around the list through Lua.
    with pytest.raises(ResponseError, match="can't run this command"):
        client.evalsha(client.script_load("return redis.call('FLUSHALL')"), 0)


def test_redis_refuses_to_start_on_the_placeholder(tmp: Path) -> None:
    """The example ACL as shipped (no digest yet) stops the server at start, instead of
    running with a user nobody can log in as."""
    binary = redis_server_path()
    assert binary is not None
    args = store_args(tmp, free_port(), None)
    r = subprocess.run([binary, *args], capture_output=True, text=True, timeout=20)
    assert r.returncode != 0
    assert "ACL" in r.stdout + r.stderr


@pytest.fixture(scope="module")
def tier(tmp: Path, store: RedisServer) -> Iterator[dict[str, Any]]:
    """The overlay's gateway, its store URL's host moved to the loopback redis-server, in
    front of one simulated engine per engine pod (`replicas`), each behind its own
    `dns+http://localhost` entry."""
    docs = render(STORE)
    sims: list[Proc] = []
    entries = []
    for entry in dns_entries(docs):
        svc = named(docs, "Service", entry.host.split(".")[0])
        (workload,) = [w for w in by_role(docs, "engine")
                       if selects({"matchLabels": svc["spec"]["selector"]},
                                  pod_template(w)["metadata"]["labels"])]  # fmt: skip
        for _ in range(workload["spec"]["replicas"]):
            sims.append(sim := sim_from_manifest(tmp, workload))
            entries.append(f"dns+http://localhost:{sim.port}")
    ((_, c),) = gateway_containers(docs)
    env = k8s_env(c)
    url = urlsplit(env["GATEWAY_STORE_URL"])
    assert url.password == STORE_PASSWORD
    netloc = f"{url.username}:{url.password}@127.0.0.1:{store.port}"
    env["GATEWAY_STORE_URL"] = urlunsplit(url._replace(netloc=netloc))
    env["GATEWAY_ENGINES"] = json.dumps(entries)
    env["GATEWAY_API_KEYS_FILE"] = str(key_file(tmp))
    env["GATEWAY_PUBLIC_METRICS"] = "true"  # for the placement counters below
    env["GATEWAY_API_KEYS"] = json.dumps(LIMITED_KEYS)
    env["GATEWAY_LIMITS__RATE_WHEN_STORE_DOWN"] = "refuse"
    env["GATEWAY_LIMITS__IN_FLIGHT_WHEN_STORE_DOWN"] = "refuse"
    gateway = gateway_proc(tmp, env)
    with running(*sims), running(gateway, ready_path="/healthz"):
        yield {"gateway": gateway, "sims": sims, "docs": docs}


def test_the_tier_gateway_places_conversations_through_the_store(tier: dict[str, Any]) -> None:
    """Six new two-turn conversations to the chat model (two engines): each first turn is
    placed in the store, each second turn read from it, none without it; the password is
    in no log line."""
    gateway: Proc = tier["gateway"]
    (chat,) = [w for w in by_role(tier["docs"], "engine") if w["metadata"]["name"] == "engine-chat"]
    model = pod_template(chat)["spec"]["containers"][0]["args"][0]

    def ready() -> bool:
        r = HTTP.get(gateway.url + "/readyz", timeout=5)
        return r.status_code == 200 and r.json()["healthy_engines"] == len(tier["sims"])

    assert wait_for(ready, 30), gateway.log()
    run = uuid.uuid4().hex[:8]
    with httpx.Client(timeout=10) as client:
        for c in range(6):
            messages = [
                {"role": "system", "content": f"You are the assistant of {run}-{c}."},
                {"role": "user", "content": "First question."},
            ]
            for turn in range(2):
                if turn:
                    messages += [
                        {"role": "assistant", "content": "An answer."},
                        {"role": "user", "content": "Second question."},
                    ]
                body = {"model": model, "messages": messages, "max_tokens": 2}
                r = client.post(gateway.url + "/v1/chat/completions", json=body, headers=HEADERS)
                assert r.status_code == 200, r.text

    def placements(result: str) -> float:
        return metric(gateway.url, "gateway_routing_store_placements_total", result=result)

    assert (placements("placed"), placements("read"), placements("fallback")) == (6, 6, 0)
    assert metric(gateway.url, "gateway_routing_store_up") == 1
    assert STORE_PASSWORD not in gateway.log()


def test_the_tier_gateway_keeps_limits_and_failed_keys_in_the_store(tier: dict[str, Any]) -> None:
    """As the ACL's `gateway` user, the limit script (the bucket and the lease) and the
    failure count run: a key with a rate and its own cap, set to refuse while the store is
    down, is answered 200 ten times, three wrong keys get 401, and the store stayed up
    with no admission decided without it (a command the ACL refused would have put it
    down: 503 limits_unavailable)."""
    gateway: Proc = tier["gateway"]
    with httpx.Client(timeout=10) as client:
        for _ in range(10):
            r = client.get(
                gateway.url + "/v1/models", headers={"Authorization": f"Bearer {LIMITED}"}
            )
            assert r.status_code == 200, r.text
        for n in range(3):
            wrong = {"Authorization": f"Bearer sk-tier-wrong-{n}-0123456789abcdef"}
            r = client.get(gateway.url + "/v1/models", headers=wrong)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
    assert metric(gateway.url, "gateway_limits_store_fallback_total") == 0
    assert metric(gateway.url, "gateway_auth_failures_total", result="counted") == 3
    assert metric(gateway.url, "gateway_store_up") == 1
