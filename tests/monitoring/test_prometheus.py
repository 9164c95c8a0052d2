"""deploy/monitoring/ in the real Prometheus (`prometheus` and `promtool`, Debian's
package; scripts/test-monitoring.sh).

promtool checks the rules and the scrape recipe and runs the rules' unit cases
(alerts_test.yaml). Then a Prometheus on a free loopback port, with its own data directory,
scrapes a live gateway as deploy/monitoring/scrape-config.yaml says (the metrics-scope key
in a credentials file), at a 1 s interval, with the alert rules (their `for:` cut to 1 s in
a test copy). The gateway fronts a simulated engine and a dead one; the traffic is
answered chats, a key over its rate, a wrong key and an image whose fetch fails. Through
Prometheus's HTTP API: the target is up, a key without the metrics scope is refused,
every dashboard query is valid PromQL and returns data when the metrics it reads were
exported, every rule evaluates, and the engine-down alert fires for the dead engine only.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.sim.config import DEFAULT_MODEL
from tests.monitoring.monitoring import (
    ALERTS,
    JOB,
    RULE_CASES,
    SCRAPE_CONFIG,
    alerts,
    dashboard,
    dashboard_queries,
    metric_names,
    substituted,
)
from tests.procs import (
    Proc,
    ask_about_image,
    auth,
    error_code,
    free_port,
    gateway_proc,
    running,
    sim_proc,
    wait_for,
)

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

ALICE = "sk-monitoring-alice-0123456789abcdef"
SLOW = "sk-monitoring-slow-0123456789abcdef"
SCRAPER = "sk-monitoring-scraper-0123456789abcdef"
KEYS = [
    {"key": ALICE, "name": "alice"},
    # One request in 100 s: the second is refused 429 rate_limited.
    {"key": SLOW, "name": "slow", "rate": {"requests_per_second": 0.01, "burst": 1}},
    {"key": SCRAPER, "name": "prometheus", "scopes": ["metrics"]},
]
# A key's requests without the metrics scope: scraped by a second job, refused.
REFUSED_JOB = "inference-key"
# Families a gateway without store_url and without audio requests does not export: the
# dashboard's shared-store panels and audio seconds have no data in this run.
NOT_EXPORTED_HERE = {
    "gateway_store_up",
    "gateway_routing_store_up",
    "gateway_routing_store_placements_total",
    "gateway_routing_store_anchors_dropped_total",
    "gateway_limits_store_fallback_total",
    "gateway_audio_seconds_total",
}


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


# --- promtool ----------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    r = promtool("check", "rules", ALERTS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout


def test_the_rule_cases_pass() -> None:
    r = promtool("test", "rules", RULE_CASES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_the_rule_cases_catch_a_broken_rule(tmp_path: Path) -> None:
    """The cases, run against rules whose engine-down alert reads the wrong value."""
    text = ALERTS.read_text()
    broken = 'gateway_engine_healthy{job="vllm-gateway"} == 1'
    assert text.count('gateway_engine_healthy{job="vllm-gateway"} == 0') == 1
    (tmp_path / "alerts.yaml").write_text(
        text.replace('gateway_engine_healthy{job="vllm-gateway"} == 0', broken)
    )
    cases = yaml.safe_load(RULE_CASES.read_text())
    cases["rule_files"] = ["alerts.yaml"]
    (tmp_path / "cases.yaml").write_text(yaml.safe_dump(cases))
    r = promtool("test", "rules", tmp_path / "cases.yaml")
    assert r.returncode != 0
    assert "alertname: VllmGatewayEngineDown" in r.stdout + r.stderr


def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    """scrape-config.yaml as written, with alerts.yaml, in a prometheus.yml."""
    key_file = tmp_path / "vllm-gateway-metrics-key"
    key_file.write_text(SCRAPER)
    recipe = SCRAPE_CONFIG.read_text().replace(
        "/etc/prometheus/vllm-gateway-metrics-key", str(key_file)
    )
    config = {"rule_files": [str(ALERTS)], **yaml.safe_load(recipe)}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    r = promtool("check", "config", tmp_path / "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout


# --- a Prometheus scraping a gateway -------------------------------------------------------


@dataclass
class Stack:
    gateway: Proc
    prometheus: Proc
    dead_engine: str
    live_engine: str

    def api(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.prometheus.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, r.text)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result


def prometheus_config(tmp: Path, gateway: Proc) -> Path:
    """deploy/monitoring/scrape-config.yaml aimed at `gateway` (its key file here, a 1 s
    interval) and a job scraping with a key without the metrics scope; the alert rules
    with every `for:` at 1 s."""
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    target = gateway.url.removeprefix("http://")
    (tmp / "metrics-key").write_text(SCRAPER)
    (tmp / "inference-key").write_text(ALICE)
    job["authorization"]["credentials_file"] = str(tmp / "metrics-key")
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    refused = {
        **job,
        "job_name": REFUSED_JOB,
        "authorization": {"type": "Bearer", "credentials_file": str(tmp / "inference-key")},
    }
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    (tmp / "alerts.yaml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "alerts.yaml")],
        "scrape_configs": [job, refused],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def prometheus_proc(tmp: Path, config: Path) -> Proc:
    port = free_port()
    (tmp / "data").mkdir()
    args = [
        "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    return Proc("prometheus", args, port, tmp / "prometheus.log")


def drive_traffic(gateway: str, media_origin: str) -> None:
    chat = {
        "model": DEFAULT_MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.Client(base_url=gateway, timeout=30) as client:
        for _ in range(3):
            r = client.post("/v1/chat/completions", headers=auth(ALICE), json=chat)
            assert r.status_code == 200, r.text
        codes = [
            error_code(client.post("/v1/chat/completions", headers=auth(SLOW), json=chat))
            for _ in range(3)
        ]
        assert codes == [None, "rate_limited", "rate_limited"]
        r = client.post("/v1/chat/completions", headers=auth("sk-not-a-key-0123456789"), json=chat)
        assert error_code(r) == "invalid_api_key"
    r = ask_about_image(gateway, ALICE, f"http://{media_origin}/cat.png")
    assert error_code(r) == "media_fetch_failed", r.text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("monitoring")
    sim = sim_proc(tmp, "--latency", "zero")
    dead_engine = f"http://127.0.0.1:{free_port()}"
    # Nothing listens there: the fetch is refused.
    media_origin = f"127.0.0.1:{free_port()}"
    env = {
        "GATEWAY_ENGINES": json.dumps([sim.url, dead_engine]),
        "GATEWAY_API_KEYS": json.dumps(KEYS),
        "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps([media_origin]),
        "GATEWAY_MEDIA__ALLOWED_SCHEMES": json.dumps(["http"]),
        "GATEWAY_MEDIA__ALLOWED_NETWORKS": json.dumps(["127.0.0.0/8"]),
    }
    gateway = gateway_proc(tmp, env)
    with running(sim), running(gateway, ready_path="/healthz"):
        prometheus = prometheus_proc(tmp, prometheus_config(tmp, gateway))
        with running(prometheus, ready_path="/-/ready"):
            drive_traffic(gateway.url, media_origin)
            yield Stack(gateway, prometheus, dead_engine, sim.url)


def targets(stack: Stack) -> dict[str, dict[str, Any]]:
    """The active targets by job, once each has been scraped."""
    active = stack.api("targets", state="active")["activeTargets"]
    return {t["scrapePool"]: t for t in active if t["health"] != "unknown"}


def test_the_gateway_is_scraped_with_the_metrics_key_only(stack: Stack) -> None:
    assert wait_for(lambda: len(targets(stack)) == 2, 30), stack.prometheus.log_tail()
    found = targets(stack)
    assert found[JOB]["health"] == "up", found[JOB]
    assert found[JOB]["labels"]["job"] == JOB
    assert found[REFUSED_JOB]["health"] == "down"
    assert "403" in found[REFUSED_JOB]["lastError"]
    (up,) = stack.query(f'up{{job="{JOB}"}}')
    assert up["value"][1] == "1"


def exported(stack: Stack) -> set[str]:
    names: list[str] = stack.api("label/__name__/values", **{"match[]": f'{{job="{JOB}"}}'})
    return set(names)


def test_every_dashboard_query_is_valid_and_has_data_where_the_traffic_made_some(
    stack: Stack,
) -> None:
    queries = {title: substituted(expr) for title, expr in dashboard_queries().items()}
    used = set().union(*(metric_names(e) for e in queries.values()))
    assert wait_for(lambda: used - exported(stack) == NOT_EXPORTED_HERE, 30), used - exported(stack)
    with_data = {t: e for t, e in queries.items() if not metric_names(e) & NOT_EXPORTED_HERE}
    # The shared store's five queries and audio seconds' one.
    assert len(queries) - len(with_data) == 6

    def empty() -> list[str]:
        return [title for title, expr in with_data.items() if not stack.query(expr)]

    # A rate needs two scrapes after the traffic.
    assert wait_for(lambda: not empty(), 30), empty()
    for expr in queries.values():
        stack.query(expr)  # valid PromQL: the API answers success (asserted in query)
    # The panels show what the traffic did.
    by_code = {
        r["metric"]["code"]: float(r["value"][1])
        for r in stack.query(substituted(dashboard_queries()["Rejections by reason/A"]))
    }
    assert {"rate_limited", "invalid_api_key", "media_fetch_failed"} <= by_code.keys()
    healthy = {
        r["metric"]["engine"]: r["value"][1]
        for r in stack.query(substituted(dashboard_queries()["Engines in rotation/A"]))
    }
    assert healthy == {stack.live_engine: "1", stack.dead_engine: "0"}
    # The instance variable's query (label_values) finds the gateway.
    (variable,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "instance"]
    assert variable["definition"] == f'label_values(up{{job="{JOB}"}}, instance)'
    series = stack.api("series", **{"match[]": f'up{{job="{JOB}"}}'})
    assert [s["instance"] for s in series] == [stack.gateway.url.removeprefix("http://")]


def test_every_rule_evaluates(stack: Stack) -> None:
    def rules() -> list[dict[str, Any]]:
        groups = stack.api("rules")["groups"]
        return [rule for group in groups for rule in group["rules"]]

    assert wait_for(lambda: all(r.get("lastEvaluation", "0001").startswith("2") for r in rules()))
    assert {r["name"] for r in rules()} == {rule["alert"] for rule in alerts()}
    assert {r["name"]: r["health"] for r in rules()} == {r["alert"]: "ok" for r in alerts()}


def test_the_engine_down_alert_fires_for_the_dead_engine(stack: Stack) -> None:
    def firing() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = stack.api("alerts")["alerts"]
        return [a for a in found if a["state"] == "firing"]

    def down() -> list[str]:
        return [
            a["labels"]["engine"]
            for a in firing()
            if a["labels"]["alertname"] == "VllmGatewayEngineDown"
        ]

    assert wait_for(lambda: bool(down()), 30), stack.api("alerts")
    assert down() == [stack.dead_engine]
    names = {a["labels"]["alertname"] for a in firing()}
    assert not names & {"VllmGatewayNoHealthyEngine", "VllmGatewayTargetDown",
                        "VllmGatewayTargetMissing", "VllmGatewayInternalErrors"}  # fmt: skip
