"""deploy/monitoring/ read without Prometheus: the rules and the PrometheusRule agree,
every metric the rules and the dashboard name is one the gateway exports, every alert has
promtool cases that fire and stay quiet and a runbook entry, and the ServiceMonitor and
PodMonitor components render with each layout, valid for Kubernetes and for the
Prometheus Operator's CRDs, selecting the gateways and nothing else.

tests/monitoring/test_prometheus.py runs the same files in the real Prometheus."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import yaml

from gateway.observability.metrics import Metrics
from tests.deploy.manifests import (
    K8S,
    LAYOUTS,
    example_secrets,
    kustomize,
    of_kind,
    pod_template,
    workloads,
)
from tests.deploy.test_routing_tier import K8S_VERSIONS, check_schemas
from tests.monitoring.monitoring import (
    ALERTS,
    DASHBOARD,
    JOB,
    MONITORING,
    OPERATIONS,
    PROMETHEUS_RULE,
    RULE_CASES,
    SCRAPE_CONFIG,
    alerts,
    dashboard,
    dashboard_queries,
    metric_names,
    rule_groups,
    substituted,
)

Docs = list[dict[str, Any]]
MONITORS = {"servicemonitor": "ServiceMonitor", "podmonitor": "PodMonitor"}
MONITORING_KINDS = frozenset({"ServiceMonitor", "PodMonitor", "PrometheusRule"})
SCHEMAS = Path(__file__).parents[1] / "data" / "prometheus-operator"
METRICS_SECRET = ("vllm-gateway-metrics-key", "key")


# --- the rules ---------------------------------------------------------------------------


def test_the_prometheus_rule_holds_the_plain_rules() -> None:
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == rule_groups()


def exported_names() -> set[str]:
    """The sample names of every metric family the gateway registers, with every
    optional part (the pool, the decode budget, both stores, connections) switched on."""
    metrics = Metrics()
    engine = SimpleNamespace(
        public_url="http://127.0.0.1:1", healthy=True, in_flight=0, waiting=0,
        kv_cache_usage=0.0, scraped=True, ejections=0,
    )  # fmt: skip
    store = SimpleNamespace(up=True, read=0, placed=0, fallback=0, dropped=0)
    metrics.watch_decodes(lambda: 0.0, lambda: 0.0)
    metrics.watch_pool(lambda: [engine], "affinity")
    metrics.watch_store(store)
    metrics.watch_shared_store(lambda: True, dict)
    metrics.watch_connections(lambda: 0)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def test_exported_names_see_every_family() -> None:
    names = exported_names()
    assert {"gateway_requests_total", "gateway_request_duration_seconds_bucket"} <= names
    assert {"gateway_store_up", "gateway_routing_store_up", "gateway_engine_healthy"} <= names


def test_rules_and_dashboard_name_only_exported_metrics() -> None:
    exported = exported_names() | {"up"}
    used = {rule["alert"]: metric_names(rule["expr"]) for rule in alerts()}
    used |= {title: metric_names(expr) for title, expr in dashboard_queries().items()}
    unknown = {where: names - exported for where, names in used.items() if names - exported}
    assert not unknown
    # Each family is on the dashboard.
    on_dashboard = set().union(*(metric_names(e) for e in dashboard_queries().values()))
    assert {n for n in exported if not n.endswith(("_sum", "_count"))} <= on_dashboard


def test_every_query_selects_the_job() -> None:
    exprs = {rule["alert"]: rule["expr"] for rule in alerts()} | dashboard_queries()
    for where, expr in exprs.items():
        selectors = re.findall(r"\b(?:gateway_\w+|up)\s*\{([^}]*)\}", expr)
        assert selectors, where
        assert all(f'job="{JOB}"' in s for s in selectors), where


def test_every_alert_has_a_severity_a_summary_and_a_runbook_entry() -> None:
    headings = re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
    for rule in alerts():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "runbook"}, rule["alert"]
        assert rule["annotations"]["runbook"] == f"docs/operations.md#{rule['alert'].lower()}"
        assert rule["alert"].lower() in anchors, rule["alert"]


def test_every_alert_has_a_case_that_fires_and_one_that_stays_quiet() -> None:
    cases = yaml.safe_load(RULE_CASES.read_text())
    assert cases["rule_files"] == [os.path.relpath(ALERTS, RULE_CASES.parent)]
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in cases["tests"]:
        for case in test["alert_rule_test"]:
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert len(names) == len(alerts())
    assert fires == names
    assert quiet == names


# --- the dashboard -----------------------------------------------------------------------


def test_dashboard_panels_read_the_datasource_variable_and_substitute() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for expr in dashboard_queries().values():
        assert "$" not in substituted(expr)


def test_dashboard_is_plain_json() -> None:
    text = DASHBOARD.read_text()
    assert json.dumps(json.loads(text), indent=2) + "\n" == text


# --- the scrape recipes -------------------------------------------------------------------


def test_the_plain_scrape_config_sets_the_job_and_reads_a_key_file() -> None:
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    assert job["job_name"] == JOB
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/etc/prometheus/vllm-gateway-metrics-key",
    }


def overlay(tmp_path: Path, layout: str, monitor: str) -> Docs:
    """`layout` with the `monitor` component, as an operator's kustomization lists them
    (in the layout's namespace, as deploy/monitoring/overlays do)."""
    layout_dir = K8S / layout
    spec: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(layout_dir, tmp_path)],
        "components": [os.path.relpath(MONITORING / monitor, tmp_path)],
    }
    namespace = yaml.safe_load((layout_dir / "kustomization.yaml").read_text()).get("namespace")
    if namespace:
        spec["namespace"] = namespace
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return kustomize(tmp_path)


def crd_schema(kind: str) -> dict[str, Any]:
    """The Prometheus Operator's schema of `kind`, strict: an unknown field is an error
    (the API server prunes it silently; `kubectl apply --validate=strict` refuses it)."""
    schema: dict[str, Any] = json.loads((SCHEMAS / f"{kind}.json").read_text())["schema"]

    def close(node: Any) -> None:
        if isinstance(node, dict):
            preserve = node.get("x-kubernetes-preserve-unknown-fields")
            if "properties" in node and "additionalProperties" not in node and not preserve:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    # metadata is the API server's: checked by name and labels here.
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def check_crds(docs: Docs) -> None:
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            try:
                # The schemas' patterns are Go's: not checked as Python's (no field
                # here has one).
                jsonschema.Draft7Validator(crd_schema(doc["kind"])).validate(doc)
            except jsonschema.ValidationError as e:
                where = ".".join(str(p) for p in e.absolute_path)
                raise AssertionError(f"{doc['kind']} at {where}: {e.message}") from None


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector with matchLabels and In/NotIn/Exists/DoesNotExist expressions."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        ok = {
            "In": present and labels.get(e["key"]) in e.get("values", []),
            "NotIn": labels.get(e["key"]) not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def gateway_pods(docs: Docs) -> list[dict[str, Any]]:
    """Pod templates with a container named `gateway`."""
    return [
        pod_template(w)
        for w in workloads(docs)
        if any(c["name"] == "gateway" for c in pod_template(w)["spec"]["containers"])
    ]


def check_monitor(docs: Docs, monitor: str) -> None:
    (mon,) = of_kind(docs, MONITORS[monitor])
    (rule,) = of_kind(docs, "PrometheusRule")
    gateways = gateway_pods(docs)
    assert gateways
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {mon["metadata"].get("namespace")}
    assert rule["spec"]["groups"] == rule_groups()
    selector = mon["spec"]["selector"]
    if monitor == "servicemonitor":
        chosen = [s for s in of_kind(docs, "Service") if selects(selector, s["metadata"]["labels"])]
        assert [s["metadata"]["name"] for s in chosen] == ["vllm-gateway"]
        (service,) = chosen
        assert service["spec"]["selector"].items() <= gateways[0]["metadata"]["labels"].items()
        endpoints = mon["spec"]["endpoints"]
        ports = {p["name"] for p in service["spec"]["ports"]}
    else:
        chosen = [t for t in (pod_template(w) for w in workloads(docs))
                  if selects(selector, t["metadata"]["labels"])]  # fmt: skip
        assert chosen == gateways
        endpoints = mon["spec"]["podMetricsEndpoints"]
        ports = {
            p["name"]: c["name"]
            for t in chosen
            for c in t["spec"]["containers"]
            for p in c.get("ports", [])
        }
        assert {ports[e["port"]] for e in endpoints} == {"gateway"}
    (endpoint,) = endpoints
    assert endpoint["port"] in ports
    assert endpoint["path"] == "/metrics"
    credentials = endpoint["authorization"]["credentials"]
    assert (credentials["name"], credentials["key"]) == METRICS_SECRET
    assert METRICS_SECRET in example_secrets()
    assert {"targetLabel": "job", "replacement": JOB} in endpoint["relabelings"]


@pytest.mark.parametrize("monitor", MONITORS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_components_render_with_every_layout(tmp_path: Path, layout: str, monitor: str) -> None:
    docs = overlay(tmp_path, layout, monitor)
    check_monitor(docs, monitor)
    check_crds(docs)
    core = [d for d in docs if d["kind"] not in MONITORING_KINDS]
    check_schemas(core, K8S_VERSIONS[-1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_shipped_overlays_are_the_layouts_with_the_service_monitor(
    tmp_path: Path, layout: str
) -> None:
    shipped = kustomize(MONITORING / "overlays" / layout)
    assert shipped == overlay(tmp_path, layout, "servicemonitor")


def test_the_checks_catch_a_monitor_that_selects_the_engines(tmp_path: Path) -> None:
    docs = overlay(tmp_path, "routing-tier", "podmonitor")
    (mon,) = of_kind(docs, "PodMonitor")
    del mon["spec"]["selector"]["matchExpressions"]
    with pytest.raises(AssertionError):
        check_monitor(docs, "podmonitor")


def test_the_checks_catch_a_misspelt_monitor_field(tmp_path: Path) -> None:
    docs = overlay(tmp_path, "base", "servicemonitor")
    (mon,) = of_kind(docs, "ServiceMonitor")
    mon["spec"]["endpoints"][0]["authorisation"] = {"type": "Bearer"}
    with pytest.raises(AssertionError, match="authorisation"):
        check_crds(docs)
