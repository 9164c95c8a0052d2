"""The shared placement store when nothing answers at its URL (no redis-server needed:
the tier with a live Redis is tests/store, scripts/test-store.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bench.sim.config import DEFAULT_MODEL as MODEL
from tests.procs import free_port, gateway_proc, metric, sim_proc, sim_received, wait_for

KEY = "sk-routing-store-fallback-0123456789"
PASSWORD = "store-password-0123456789"


@pytest.mark.slow
def test_requests_are_served_when_the_store_refuses(tmp_path: Path) -> None:
    """Nothing listens at the store's address: every request is answered by an engine,
    each one counted as placed without the store, and one log line (without the
    password) says the store is down."""
    sims = [sim_proc(tmp_path, "--latency", "zero") for _ in range(2)]
    env = {
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        "GATEWAY_ROUTING__STORE_URL": f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0",
        "GATEWAY_ROUTING__STORE_RETRY": "0.05",
        "GATEWAY_PUBLIC_METRICS": "true",
    }
    gateway = None
    try:
        for sim in sims:
            sim.start()
        env["GATEWAY_ENGINES"] = json.dumps([s.url for s in sims])
        gateway = gateway_proc(tmp_path, env).start("/healthz")
        headers = {"Authorization": f"Bearer {KEY}"}
        assert wait_for(
            lambda: MODEL in httpx.get(gateway.url + "/v1/models", headers=headers).text
        )
        with httpx.Client(timeout=10) as client:
            for i in range(12):
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Question {i}."}],
                    "max_tokens": 2,
                }
                r = client.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
        engines = sum(
            sim_received(s.url, exclude_paths=("/health", "/metrics", "/v1/models")) for s in sims
        )
        assert engines == 12
        placements = "gateway_routing_store_placements_total"
        assert metric(gateway.url, placements, result="fallback") == 12
        assert metric(gateway.url, placements, result="placed") == 0
        assert metric(gateway.url, "gateway_routing_store_up") == 0
        log = gateway.log()
        assert PASSWORD not in log
        down = [line for line in log.splitlines() if '"event":"store"' in line]
        assert len(down) == 1, down
        assert "ConnectionError" in down[0] and "127.0.0.1" in down[0]
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in sims:
            sim.stop()
