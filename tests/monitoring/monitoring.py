"""deploy/monitoring/ as the tests read it: the alert rules, their promtool cases and the
dashboard's queries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.procs import ROOT

MONITORING = ROOT / "deploy" / "monitoring"
ALERTS = MONITORING / "alerts.yaml"
PROMETHEUS_RULE = MONITORING / "rules" / "prometheusrule.yaml"
DASHBOARD = MONITORING / "dashboard.json"
SCRAPE_CONFIG = MONITORING / "scrape-config.yaml"
RULE_CASES = Path(__file__).parent / "alerts_test.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
# The job every rule and dashboard query selects, and every scrape recipe sets.
JOB = "vllm-gateway"
# What a dashboard query is evaluated with outside Grafana: its variables' values (every
# gateway instance; a rate window of a few scrapes at the tests' 1 s interval).
GRAFANA_VARIABLES = {"instance": ".*", "__rate_interval": "15s"}


def rule_groups(path: Path = ALERTS) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(path.read_text())["groups"]
    return groups


def alerts() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_queries() -> dict[str, str]:
    """Every panel query as Grafana writes it, by `panel title/refId`."""
    return {
        f"{panel['title']}/{target['refId']}": target["expr"]
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    }


def substituted(expr: str) -> str:
    """`expr` with the Grafana variables (`$name`, `${name}`) given their test values;
    a variable without one is an error."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in GRAFANA_VARIABLES, f"no test value for ${name} in {expr}"
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a query reads (the gateway's, and Prometheus's `up`)."""
    return set(re.findall(r"\b(gateway_\w+|up)\s*\{", expr))
