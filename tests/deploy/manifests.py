"""Reading deploy/'s Kubernetes manifests as the cluster would get them.

One renderer (`render`) for every kustomization, without the kustomize binary: resources,
components, strategic-merge `patches` and `namespace`, the fields deploy/ uses. Any other field of
a kustomization.yaml is refused rather than ignored, and
test_routing_tier.test_renderer_agrees_with_kubectl_kustomize compares the result with
`kubectl kustomize` where kubectl is installed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from tests.procs import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The kustomizations under deploy/k8s, by directory name.
LAYOUTS = ("base", "passthrough", "routing-tier", "routing-tier-store")
UPSTREAM = "upstream-deploy-test-0123456789abcdef"
STORE_PASSWORD = "store-deploy-test-0123456789abcdef"
NAMESPACE_SECRET = "namespace-deploy-test-0123456789abcdef"
# The variable every gateway reads payload.namespace_secret from.
NAMESPACE_ENV = "GATEWAY_PAYLOAD__NAMESPACE_SECRET"
# Kinds without a namespace among those a kustomization here may hold.
CLUSTER_SCOPED = frozenset({"Namespace", "PersistentVolume", "StorageClass", "ClusterRole"})
POD_TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"})
_KUSTOMIZATION_FIELDS = frozenset(
    {"apiVersion", "kind", "resources", "components", "patches", "namespace"}
)


def load_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def example_secrets() -> dict[tuple[str, str], str]:
    """(Secret, key) -> the placeholder value secrets.example.yaml gives it."""
    return {
        (d["metadata"]["name"], key): value
        for d in load_all(K8S / "secrets.example.yaml")
        for key, value in d["stringData"].items()
    }


def with_password(url: str, password: str) -> str:
    """A redis:// URL with its password replaced."""
    parts = urlsplit(url)
    netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


# What the operator puts in the Secrets (secrets.example.yaml names them): the store's URL
# is the example's, with a password.
K8S_SECRETS = {
    ("vllm-upstream-key", "api-key"): UPSTREAM,
    ("vllm-gateway-namespace", "secret"): NAMESPACE_SECRET,
    ("vllm-routing-store-url", "url"): with_password(
        example_secrets()[("vllm-routing-store-url", "url")], STORE_PASSWORD
    ),
}


def strategic_merge(base: Any, patch: Any) -> Any:
    """Enough of Kubernetes' strategic merge for our patches: lists of named objects
    (containers, env) merge by name, the patch's items first in its order and then the
    base's other items (as kustomize orders them), other lists are replaced, mappings
    merge."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        named = all(isinstance(x, dict) and "name" in x for x in base + patch)
        if named and patch:
            by_name = {x["name"]: x for x in base}
            merged = [
                strategic_merge(by_name[x["name"]], x) if x["name"] in by_name else copy.deepcopy(x)
                for x in patch
            ]
            patched = {x["name"] for x in patch}
            return merged + [copy.deepcopy(x) for x in base if x["name"] not in patched]
    return copy.deepcopy(patch)


def kustomize(directory: Path, parent: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The manifests of the kustomization in `directory`; a Component (kind) adds to and
    patches `parent`, the manifests of the kustomization that lists it so far."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = sorted(set(spec) - _KUSTOMIZATION_FIELDS)
    assert not unsupported, f"{directory}: the test renderer does not implement {unsupported}"
    component = spec.get("kind") == "Component"
    assert component == (parent is not None), f"{directory}: a Component only in `components`"
    docs: list[dict[str, Any]] = parent if parent is not None else []
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        docs.extend(kustomize(path) if path.is_dir() else load_all(path))
    for entry in spec.get("components", []):
        docs = kustomize((directory / entry).resolve(), docs)
    for entry in spec.get("patches", []):
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        for i, doc in enumerate(docs):
            if (doc["kind"], doc["metadata"]["name"]) == (
                patch["kind"],
                patch["metadata"]["name"],
            ):
                docs[i] = strategic_merge(doc, patch)
    if namespace := spec.get("namespace"):
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    return docs


@cache
def _rendered(layout: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(K8S / layout))


def render(layout: str) -> list[dict[str, Any]]:
    """The manifests `kubectl apply -k deploy/k8s/<layout>` sends (a copy each call, so a
    test may break one without breaking the others)."""
    return copy.deepcopy(list(_rendered(layout)))


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return found


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in POD_TEMPLATE_KINDS]


def pod_template(workload: Mapping[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = workload["spec"]["template"]
    return template


def containers(pod_spec: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a label selector picks a pod with `labels`. Only matchLabels is read, so a
    selector with anything else fails the test instead of being half understood."""
    assert set(selector) <= {"matchLabels"}, f"selector not understood here: {selector}"
    wanted: dict[str, str] = selector.get("matchLabels", {})
    return wanted.items() <= labels.items()


def k8s_env(c: Mapping[str, Any]) -> dict[str, str]:
    """A container's environment with Secrets filled in from K8S_SECRETS. Only literal
    values and Secret references; a downward-API value reads as `<fieldRef:path>`."""
    out: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = str(e["value"])
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = K8S_SECRETS[(ref["name"], ref["key"])]
        else:
            out[e["name"]] = f"<fieldRef:{e['valueFrom']['fieldRef']['fieldPath']}>"
    return out


def secret_ref(c: Mapping[str, Any], name: str) -> tuple[str, str] | None:
    """(Secret, key) that variable `name` of container `c` comes from; None if it does
    not come from a Secret (or is absent)."""
    for e in c.get("env", []):
        if e["name"] == name and "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            return ref["name"], ref["key"]
    return None


def flag_values(args: list[str], flag: str) -> list[str] | None:
    """Values of an argparse flag given as `--f=v` or `--f v1 v2 ...`; None if absent."""
    for i, a in enumerate(args):
        if a == flag:
            values = []
            for v in args[i + 1 :]:
                if v.startswith("--"):
                    break
                values.append(v)
            return values
        if a.startswith(flag + "="):
            return [a.split("=", 1)[1]]
    return None
