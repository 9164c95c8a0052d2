"""deploy/k8s: every rendered manifest against the Kubernetes schemas, and the routing
tier's security and wiring, with and without its shared placement store.

Each property is a check over a whole render (`check_*`), run on the layouts, and run
again on renders broken one way each (`BREAKAGES`): a check that passed a broken
manifest would fail test_each_check_catches_its_breakage. The routing tier's gateway is
also run as a process in front of simulated engines started from the engine manifests,
discovering them by `dns+http://` as it would the headless Services (with a real Redis
for the store: tests/store/test_routing_tier_store.py).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from pydantic import ValidationError

from bench.harness.metrics import HTTP
from gateway.config.settings import Settings
from gateway.payload.settings import PLACEHOLDER_PREFIX, PayloadSettings
from gateway.routing.dns import DnsEntry, is_dns_entry
from tests.deploy.manifests import (
    DEPLOY,
    K8S,
    K8S_SECRETS,
    LAYOUTS,
    NAMESPACE_ENV,
    NAMESPACE_SECRET,
    UPSTREAM,
    containers,
    example_secrets,
    flag_values,
    k8s_env,
    kustomize,
    load_all,
    named,
    of_kind,
    pod_template,
    render,
    secret_ref,
    selects,
    workloads,
)
from tests.procs import Proc, gateway_proc, run_cli, running, sim_proc, wait_for

Docs = list[dict[str, Any]]
TIER = "routing-tier"
STORE = "routing-tier-store"
# The routing tier alone and with its shared placement store: every tier check holds in both.
TIERS = (TIER, STORE)
CLIENT_KEY = "sk-routing-tier-test-0123456789abcdef"
# The oldest and the newest Kubernetes the validator bundles schemas for.
K8S_VERSIONS = (all_versions()[0], all_versions()[-1])
ENGINE_PORT = 8000
GATEWAY_PORT = 8080
STORE_PORT = 6379


# --- reading a render ------------------------------------------------------------------


def role(workload: dict[str, Any]) -> str:
    """`gateway` or `engine`, from the pod's labels (the sidecar pod is both: `pod`)."""
    labels = pod_template(workload)["metadata"]["labels"]
    return str(labels.get("app.kubernetes.io/component", "pod"))


def by_role(docs: Docs, wanted: str) -> Docs:
    return [w for w in workloads(docs) if role(w) == wanted]


def vllm_containers(docs: Docs) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every vLLM in the render."""
    for w in workloads(docs):
        spec = pod_template(w)["spec"]
        for c in containers(spec):
            if c["image"].startswith("vllm/"):
                yield spec, c


def gateway_containers(docs: Docs) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for w in workloads(docs):
        spec = pod_template(w)["spec"]
        for c in containers(spec):
            if c["image"].startswith("vllm-gateway:"):
                yield spec, c


def store_containers(docs: Docs) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for w in workloads(docs):
        spec = pod_template(w)["spec"]
        for c in containers(spec):
            if c["image"].startswith("redis:"):
                yield spec, c


def the_gateway(docs: Docs) -> dict[str, Any]:
    (gateway,) = by_role(docs, "gateway")
    return gateway


def env_var(c: dict[str, Any], name: str) -> dict[str, Any] | None:
    found = [e for e in c.get("env", []) if e["name"] == name]
    assert len(found) <= 1, f"{name} set twice"
    return found[0] if found else None


def mounts(spec: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[dict[str, Any], bool]]:
    """mountPath -> (volume, read-only) of a container."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {
        m["mountPath"]: (volumes[m["name"]], bool(m.get("readOnly")))
        for m in c.get("volumeMounts", [])
    }


def volume_under(spec: dict[str, Any], c: dict[str, Any], path: str) -> tuple[dict[str, Any], bool]:
    """The volume a path lies on (the deepest mount above it)."""
    found = [
        (len(PurePosixPath(m).parts), v)
        for m, v in mounts(spec, c).items()
        if PurePosixPath(path).is_relative_to(m)
    ]
    assert found, f"{c['name']}: {path} is on the container's root filesystem"
    return max(found, key=lambda x: x[0])[1]


def policies_selecting(docs: Docs, labels: dict[str, str]) -> Docs:
    return [p for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"], labels)]


def pod_labels(docs: Docs, wanted: str) -> list[dict[str, str]]:
    return [pod_template(w)["metadata"]["labels"] for w in by_role(docs, wanted)]


def container_port(c: dict[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in c.get("ports", []) if p["name"] == name_or_number]
    return int(port)


# --- the checks --------------------------------------------------------------------------


def check_schemas(docs: Docs, version: str) -> None:
    """Every manifest is valid for the Kubernetes API of `version`, strictly (an unknown
    field is an error, as `kubectl apply --validate=strict` makes it)."""
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(f"{where} at {path}: {e.message}") from None
        except kubernetes_validate.SchemaNotFoundError as e:
            raise AssertionError(f"{where}: {e.message}") from None


def check_non_root(docs: Docs) -> None:
    """Pod Security's `restricted` profile, and a read-only root, for every container."""
    assert workloads(docs)
    for w in workloads(docs):
        spec = pod_template(w)["spec"]
        name = w["metadata"]["name"]
        assert not (spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC")), name
        assert spec.get("automountServiceAccountToken") is False, name
        pod_sc = spec.get("securityContext", {})
        for v in spec.get("volumes", []):
            assert set(v) & {"emptyDir", "secret", "persistentVolumeClaim"}, (name, v)
        for c in containers(spec):
            sc = c.get("securityContext", {})
            where = f"{name}/{c['name']}"

            def effective(key: str, sc: dict[str, Any] = sc, pod: dict[str, Any] = pod_sc) -> Any:
                return sc.get(key, pod.get(key))

            assert effective("runAsNonRoot") is True, where
            uid = effective("runAsUser")
            assert isinstance(uid, int) and uid > 0, where
            assert isinstance(effective("runAsGroup"), int) and effective("runAsGroup") > 0, where
            assert effective("seccompProfile") == {"type": "RuntimeDefault"}, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("privileged") in (None, False), where
            assert sc.get("capabilities") == {"drop": ["ALL"]}, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            # Writable: emptyDirs only; Secrets and the models' claim are read-only.
            for path, (volume, read_only) in mounts(spec, c).items():
                assert read_only or "emptyDir" in volume, (where, path)


def check_vllm_caches(docs: Docs) -> None:
    """vLLM's home and every cache under it on an emptyDir; the weights read-only and
    offline."""
    found = list(vllm_containers(docs))
    assert found
    for spec, c in found:
        env = k8s_env(c)
        for name in ("HOME", "HF_HOME"):
            volume, read_only = volume_under(spec, c, env[name])
            assert "emptyDir" in volume and not read_only, (c["name"], name)
        for name in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
            assert name not in env or PurePosixPath(env[name]).is_relative_to(env["HOME"])
        assert env.get("USER"), "torch's cache asks getpass for a user name"
        volume, read_only = volume_under(spec, c, env["HF_HUB_CACHE"])
        assert "persistentVolumeClaim" in volume and read_only
        assert volume["persistentVolumeClaim"].get("readOnly") is True
        assert env["HF_HUB_OFFLINE"] == "1"


def check_upstream_key(docs: Docs) -> None:
    """The engines' key and the gateways' upstream key are one Secret's one key, and
    neither is written in a manifest or on a command line."""
    refs = set()
    for _, c in vllm_containers(docs):
        ref = secret_ref(c, "VLLM_API_KEY")  # vLLM's --api-key, read from its variable
        assert ref, f"{c['name']}: VLLM_API_KEY not from a Secret"
        assert flag_values(c.get("args", []), "--api-key") is None
        refs.add(ref)
    for _, c in gateway_containers(docs):
        ref = secret_ref(c, "GATEWAY_UPSTREAM_API_KEY")
        assert ref, f"{c['name']}: GATEWAY_UPSTREAM_API_KEY not from a Secret"
        refs.add(ref)
    assert len(refs) == 1, f"engines and gateways read different keys: {sorted(refs)}"
    ((secret, key),) = refs
    examples = {d["metadata"]["name"]: d for d in load_all(K8S / "secrets.example.yaml")}
    assert key in examples[secret]["stringData"]


def check_namespace_secret(docs: Docs) -> None:
    """Every gateway reads payload.namespace_secret from one Secret key of the example,
    the same for all (a replica with another would refuse the others' ids), never
    written in a manifest."""
    refs = set()
    found = list(gateway_containers(docs))
    assert found
    for _, c in found:
        ref = secret_ref(c, NAMESPACE_ENV)
        assert ref, f"{c['name']}: {NAMESPACE_ENV} not from a Secret"
        refs.add(ref)
    assert len(refs) == 1, f"gateways read different namespace secrets: {sorted(refs)}"
    (ref,) = refs
    assert ref in example_secrets() and ref in K8S_SECRETS, ref


def check_engines_listen_on_the_pod_ip(docs: Docs) -> None:
    engines = by_role(docs, "engine")
    assert engines
    for w in engines:
        spec = pod_template(w)["spec"]
        (c,) = spec["containers"]
        assert flag_values(c["args"], "--host") == ["$(POD_IP)"]
        # $(POD_IP) is expanded only if the container defines it.
        pod_ip = env_var(c, "POD_IP")
        assert pod_ip and pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert flag_values(c["args"], "--port") == [str(ENGINE_PORT)]
        assert container_port(c, "http") == ENGINE_PORT
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe


def check_fence(docs: Docs, component: str, port: int) -> None:
    """Every policy that selects a `component` pod admits only the gateway pods, on
    `port`, and lets the pod send nothing; the gateways' policies let them reach it."""
    gateways, fenced = pod_labels(docs, "gateway"), pod_labels(docs, component)
    others = [pod_template(w)["metadata"]["labels"] for w in workloads(docs)
              if role(w) != "gateway"]  # fmt: skip
    assert gateways and fenced
    for labels in fenced:
        policies = policies_selecting(docs, labels)
        assert policies, f"no NetworkPolicy selects {component} pods {labels}"
        for p in policies:
            spec = p["spec"]
            assert set(spec["policyTypes"]) == {"Ingress", "Egress"}, p["metadata"]["name"]
            assert spec.get("egress", []) == [], f"{component} pods send nothing"
            assert spec["ingress"], "no ingress rule: nobody, not even the gateways"
            for rule in spec["ingress"]:
                # A rule without `from` admits every source.
                assert rule.get("from"), "a rule admits every source"
                for peer in rule["from"]:
                    # No namespaceSelector (other namespaces) and no ipBlock.
                    assert set(peer) == {"podSelector"}, peer
                    assert any(selects(peer["podSelector"], g) for g in gateways)
                    assert not any(selects(peer["podSelector"], o) for o in others)
                assert rule.get("ports") == [{"protocol": "TCP", "port": port}]
    # The gateways' own policies let them reach the pods (else every request fails).
    for labels in gateways:
        egress = [r for p in policies_selecting(docs, labels) for r in p["spec"].get("egress", [])]
        reaching = [
            r
            for r in egress
            if any("podSelector" in t and all(selects(t["podSelector"], f) for f in fenced)
                   for t in r.get("to", []))
        ]  # fmt: skip
        assert reaching, f"the gateways' policies do not let them reach the {component} pods"
        assert any({"protocol": "TCP", "port": port} in r.get("ports", []) for r in reaching)


def check_engine_fence(docs: Docs) -> None:
    check_fence(docs, "engine", ENGINE_PORT)


def dns_entries(docs: Docs) -> list[DnsEntry]:
    (_, gateway), *more = list(gateway_containers(docs))
    assert not more, "one gateway container"
    entries = json.loads(k8s_env(gateway)["GATEWAY_ENGINES"])
    assert entries and all(is_dns_entry(e) for e in entries), entries
    return [DnsEntry(e) for e in entries]


def check_discovery(docs: Docs) -> None:
    """Each `dns+http://` entry names a headless Service of the render by its cluster
    name, on the engines' port, and every engine workload is behind one of them."""
    covered = set()
    for entry in dns_entries(docs):
        assert entry.scheme == "http" and entry.base_path == ""
        service, namespace, *suffix = entry.host.split(".")
        assert suffix == ["svc", "cluster", "local"], entry.host
        found = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == service]
        assert len(found) == 1, f"no Service {service} for {entry.host}"
        svc = found[0]
        assert svc["metadata"]["namespace"] == namespace, entry.host
        assert svc["spec"].get("clusterIP") == "None", f"{service} is not headless"
        (port,) = svc["spec"]["ports"]
        assert port["port"] == entry.port
        behind = [w for w in by_role(docs, "engine")
                  if selects({"matchLabels": svc["spec"]["selector"]},
                             pod_template(w)["metadata"]["labels"])]  # fmt: skip
        assert behind, f"{service} selects no engine pods"
        for w in behind:
            assert w["metadata"]["namespace"] == namespace
            (c,) = pod_template(w)["spec"]["containers"]
            assert container_port(c, port["targetPort"]) == ENGINE_PORT
            covered.add(w["metadata"]["name"])
    engines = {w["metadata"]["name"] for w in by_role(docs, "engine")}
    assert covered == engines, f"engines no gateway finds: {sorted(engines - covered)}"


def check_gateway_scaling(docs: Docs) -> None:
    """Two or more gateways, a disruption budget and a CPU autoscaler on them."""
    gateway = the_gateway(docs)
    name = gateway["metadata"]["name"]
    assert gateway["kind"] == "Deployment" and gateway["spec"]["replicas"] >= 2
    labels = pod_template(gateway)["metadata"]["labels"]
    others = [pod_template(w)["metadata"]["labels"] for w in workloads(docs) if w is not gateway]
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", name)
    assert hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    # Utilization is a share of the request: without one the autoscaler does nothing.
    for c in pod_template(gateway)["spec"]["containers"]:
        assert c["resources"]["requests"].get("cpu"), "no CPU request"
    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"], labels)
    assert not any(selects(pdb["spec"]["selector"], o) for o in others)
    assert pdb["spec"].get("maxUnavailable") == 1 or (
        0 < pdb["spec"].get("minAvailable", 0) < hpa["spec"]["minReplicas"]
    )
    # The Service clients use sends to the gateways only, on their port.
    (service,) = [s for s in of_kind(docs, "Service")
                  if s["spec"].get("clusterIP") != "None"
                  and selects({"matchLabels": s["spec"]["selector"]}, labels)]  # fmt: skip
    assert selects({"matchLabels": service["spec"]["selector"]}, labels)
    assert not any(selects({"matchLabels": service["spec"]["selector"]}, o) for o in others)
    (c,) = pod_template(gateway)["spec"]["containers"]
    assert [p["port"] for p in service["spec"]["ports"]] == [GATEWAY_PORT]
    assert container_port(c, service["spec"]["ports"][0]["targetPort"]) == GATEWAY_PORT


def check_gateway_probes(docs: Docs) -> None:
    """Ready only with a healthy engine (/readyz); alive while it serves (/healthz). The
    process test below checks that the gateway answers both."""
    for _, c in gateway_containers(docs):
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("readinessProbe", "livenessProbe"):
            assert container_port(c, c[probe]["httpGet"]["port"]) == GATEWAY_PORT, probe


def check_namespace_is_restricted(docs: Docs) -> None:
    (ns,) = of_kind(docs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    name = ns["metadata"]["name"]
    assert all(d["metadata"]["namespace"] == name for d in docs if d is not ns)


# --- the shared placement store (routing-tier-store) -----------------------------------------

# An exact release (`name:1.2.3`, `v1.2.3`, with a `-variant`), never `latest` or a floating
# `7.4-alpine`, which change under the same manifest.
IMAGE_TAG = re.compile(r"^[\w./-]+:v?\d+\.\d+\.\d+(-[\w.]+)?$")
STORE_IMAGE = re.compile(r"^redis:(\d+)\.(\d+)\.(\d+)-alpine$")
# 7.4.9 fixed CVE-2026-23631 (a Lua use-after-free) and CVE-2026-23479; the gateway user
# runs Lua scripts.
STORE_OLDEST = (7, 4, 9)
# What the gateways run (gateway/routing/store.py, gateway/store/): EVALSHA, and SCRIPT
# LOAD when Redis does not know a script yet; inside the placement script TIME, HMGET,
# HSET, PEXPIRE, the key's anchors' ZADD, ZREM, ZREMRANGEBYSCORE, ZCARD and ZPOPMIN, and
# HGET and DEL of the anchors past its bound; inside the limits' scripts also
# ZREMRANGEBYSCORE, ZCARD and ZADD, inside the failure count INCR; ZREM gives leases
# back. PING: the probes, and a client checking its connection.
STORE_COMMANDS = {
    "evalsha", "script|load", "time", "hmget", "hset", "pexpire", "zremrangebyscore", "zcard",
    "zadd", "zrem", "zpopmin", "hget", "del", "incr", "ping",
}  # fmt: skip
URL_WITH_PASSWORD = re.compile(r"rediss?://[^\s/@]*:[^\s/@]+@")
# requirepass and masterauth, an ACL clear password (`>secret`) or a digest (`#<sha256>`).
PASSWORD_TEXT = re.compile(r"requirepass|masterauth|(^|\s)>\S|#[0-9a-f]{64}")
_REDIS_UNITS = {"kb": 1024, "mb": 1024**2, "gb": 1024**3}
_K8S_UNITS = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}


def redis_options(args: list[str]) -> dict[str, list[str]]:
    """redis-server's `--name value...` arguments, by name."""
    options: dict[str, list[str]] = {}
    name = None
    for a in args:
        if a.startswith("--"):
            name = a.removeprefix("--")
            assert name not in options, f"--{name} given twice"
            options[name] = []
        else:
            assert name is not None, f"a value before any option: {a!r}"
            options[name].append(a)
    return options


def _bytes(size: str, units: dict[str, int]) -> int:
    for unit, factor in units.items():
        if size.endswith(unit):
            return int(size.removesuffix(unit)) * factor
    return int(size)


def store_users_ref(docs: Docs) -> tuple[str, str]:
    """(Secret, key) the store reads its users from: its --aclfile, on a Secret volume."""
    ((spec, c),) = store_containers(docs)
    (aclfile,) = redis_options(c["args"])["aclfile"]
    found = [v for m, (v, _) in mounts(spec, c).items()
             if PurePosixPath(aclfile).parent == PurePosixPath(m)]  # fmt: skip
    assert found, f"--aclfile {aclfile} is not a file of a mounted volume"
    (volume,) = found
    assert "secret" in volume, f"--aclfile {aclfile} is not on a Secret volume"
    return volume["secret"]["secretName"], PurePosixPath(aclfile).name


def check_images_pinned(docs: Docs) -> None:
    for w in workloads(docs):
        for c in containers(pod_template(w)["spec"]):
            assert IMAGE_TAG.match(c["image"]), f"{w['metadata']['name']}: {c['image']}"


def check_store(docs: Docs) -> None:
    """One Redis, in memory only, bounded below its memory limit, probed with PING, its
    users read from a read-only Secret file and no password in its arguments or
    environment."""
    (store,) = by_role(docs, "store")
    assert store["kind"] == "Deployment" and store["spec"]["replicas"] == 1
    # A rolling update would run the old and the new store side by side.
    assert store["spec"]["strategy"] == {"type": "Recreate"}
    spec = pod_template(store)["spec"]
    (c,) = spec["containers"]
    version = STORE_IMAGE.match(c["image"])
    assert version and tuple(map(int, version.groups())) >= STORE_OLDEST, c["image"]
    assert c["command"] == ["redis-server"]
    opts = redis_options(c["args"])
    assert opts["port"] == [str(STORE_PORT)] and container_port(c, "redis") == STORE_PORT
    assert opts["save"] == [""] and opts["appendonly"] == ["no"], "persistence is on"
    assert not {"requirepass", "masterauth", "masteruser", "include"} & set(opts)
    assert "env" not in c and "envFrom" not in c, "a variable could carry a password in"
    secret, key = store_users_ref(docs)
    assert (secret, key) in example_secrets()
    _, read_only = volume_under(spec, c, opts["aclfile"][0])
    assert read_only, "the users file is writable"
    assert opts["maxmemory-policy"] in (["allkeys-lru"], ["volatile-lru"])
    limit = _bytes(c["resources"]["limits"]["memory"], _K8S_UNITS)
    assert _bytes(opts["maxmemory"][0], _REDIS_UNITS) <= limit // 2, "evicts too late"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == ["redis-cli", "-p", str(STORE_PORT), "ping"]
        assert c[probe]["timeoutSeconds"] >= 1, probe


def check_store_fence(docs: Docs) -> None:
    check_fence(docs, "store", STORE_PORT)


def check_store_users(acl: str, user: str, prefix: str) -> None:
    """The store's ACL file: the gateways' user by a password digest only, on the gateways'
    keys only, with the placement script's commands only; without a password, PING only."""
    users: dict[str, list[str]] = {}
    for line in filter(str.strip, acl.splitlines()):
        word, name, *rules = line.split()
        assert word == "user" and name not in users, line
        users[name] = rules
    assert set(users) == {"default", user}, sorted(users)
    for name, rules in users.items():
        # Commands granted before -@all would be taken away again: -@all comes first.
        grants = [i for i, r in enumerate(rules) if r.startswith("+")]
        assert "on" in rules and "-@all" in rules, name
        assert all(rules.index("-@all") < i for i in grants), name
        for r in rules:
            assert r[0] not in "><", f"{name}: a clear password"
            assert r in ("on", "nopass", "resetchannels", "-@all") or r[0] in "#+~", (name, r)
        commands = {r.removeprefix("+").lower() for r in rules if r.startswith("+")}
        keys = [r for r in rules if r.startswith("~")]
        digests = [r for r in rules if r.startswith("#")]
        if name == "default":
            assert commands == {"ping"} and keys == [] and digests == [], rules
        else:
            assert commands == STORE_COMMANDS and keys == [f"~{prefix}:*"], rules
            assert len(digests) == 1 and "nopass" not in rules, rules


def check_store_url(docs: Docs) -> None:
    """The gateways read the store's URL, password included, from a Secret key of the
    example. It names the store's Service by its cluster name, on its port, as a user the
    store's ACL file (the example's) lets run the placement script on the gateways' keys."""
    found = list(gateway_containers(docs))
    assert found
    for _, c in found:
        ref = secret_ref(c, "GATEWAY_STORE_URL")
        assert ref, f"{c['name']}: GATEWAY_STORE_URL not from a Secret"
        assert ref in example_secrets() and ref in K8S_SECRETS, ref
        env = k8s_env(c)
        url = urlsplit(env["GATEWAY_STORE_URL"])
        assert url.scheme == "redis" and url.username and url.password and url.path == "/0"
        service, namespace, *suffix = str(url.hostname).split(".")
        assert suffix == ["svc", "cluster", "local"], url.hostname
        svcs = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == service]
        assert len(svcs) == 1, f"no Service {service} for the store's URL"
        svc = svcs[0]
        assert svc["metadata"]["namespace"] == namespace and svc["spec"].get("clusterIP") != "None"
        (port,) = svc["spec"]["ports"]
        assert port["port"] == url.port, "the URL's port is not the Service's"
        behind = [w for w in by_role(docs, "store")
                  if selects({"matchLabels": svc["spec"]["selector"]},
                             pod_template(w)["metadata"]["labels"])]  # fmt: skip
        assert len(behind) == 1, f"{service} does not select the store"
        (store_c,) = pod_template(behind[0])["spec"]["containers"]
        assert container_port(store_c, port["targetPort"]) == STORE_PORT
        prefix = env.get("GATEWAY_STORE_PREFIX", Settings.model_fields["store_prefix"].default)
        check_store_users(example_secrets()[store_users_ref(docs)], url.username, prefix)


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def check_no_password_literal(docs: Docs) -> None:
    """No manifest holds a password (or a digest of one): no URL with a password, no
    requirepass, no ACL rule; a variable named for a password, an auth token or the
    store's URL comes from a Secret."""
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        for text in _strings(doc):
            assert not URL_WITH_PASSWORD.search(text), f"{where}: a URL with a password"
            assert not PASSWORD_TEXT.search(text), f"{where}: {text[:60]!r}"
    for w in workloads(docs):
        for c in containers(pod_template(w)["spec"]):
            for e in c.get("env", []):
                if re.search(r"PASS|AUTH|SECRET|TOKEN|_KEY$|STORE_URL", e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), (c["name"], e["name"])


STORE_CHECKS: dict[str, Callable[[Docs], None]] = {
    "store": check_store,
    "store_fence": check_store_fence,
    "store_url": check_store_url,
}


TIER_CHECKS: dict[str, Callable[[Docs], None]] = {
    "upstream_key": check_upstream_key,
    "engines_listen_on_the_pod_ip": check_engines_listen_on_the_pod_ip,
    "engine_fence": check_engine_fence,
    "discovery": check_discovery,
    "gateway_scaling": check_gateway_scaling,
    "gateway_probes": check_gateway_probes,
    "namespace_is_restricted": check_namespace_is_restricted,
}


# --- the manifests pass ------------------------------------------------------------------


def secrets_example() -> Docs:
    return load_all(K8S / "secrets.example.yaml")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("layout", [*LAYOUTS, "secrets.example.yaml"])
def test_every_manifest_matches_the_kubernetes_schema(layout: str, version: str) -> None:
    docs = secrets_example() if layout.endswith(".yaml") else render(layout)
    assert docs
    check_schemas(docs, version)


def test_schema_validation_is_offline_and_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas come with the package: validation works with every connection and
    name lookup refused; and it refuses what `kubectl apply` would."""

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    check_schemas(render(TIER), K8S_VERSIONS[-1])
    deployment = named(render(TIER), "Deployment", "vllm-gateway")
    c = pod_template(deployment)["spec"]["containers"][0]
    c["securityContext"]["runAsUSer"] = 10001  # a misspelt field
    with pytest.raises(AssertionError, match="runAsUSer"):
        check_schemas([deployment], K8S_VERSIONS[-1])
    del c["securityContext"]["runAsUSer"]
    c["ports"][0]["containerPort"] = "8080"  # a string where an integer belongs
    with pytest.raises(AssertionError, match="containerPort"):
        check_schemas([deployment], K8S_VERSIONS[-1])
    with pytest.raises(AssertionError, match="Couldn't find schema"):
        check_schemas([{"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {}}],
                      K8S_VERSIONS[-1])  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_container_runs_non_root_on_a_read_only_root(layout: str) -> None:
    check_non_root(render(layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_home_and_caches_are_on_an_empty_dir(layout: str) -> None:
    check_vllm_caches(render(layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engines_and_gateways_share_one_upstream_key(layout: str) -> None:
    check_upstream_key(render(layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_gateway_reads_one_namespace_secret(layout: str) -> None:
    check_namespace_secret(render(layout))


def test_the_example_namespace_secret_is_a_placeholder_the_gateway_refuses() -> None:
    """Applied unchanged, the example would give every deployment the same secret: the
    gateway refuses to start on it."""
    (ref,) = {secret_ref(c, NAMESPACE_ENV) for _, c in gateway_containers(render(TIER))}
    assert ref is not None
    placeholder = example_secrets()[ref]
    assert placeholder.startswith(PLACEHOLDER_PREFIX)
    with pytest.raises(ValidationError, match="placeholder"):
        PayloadSettings.model_validate({"namespace_secret": placeholder})
    assert PayloadSettings.model_validate({"namespace_secret": NAMESPACE_SECRET})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_image_is_an_exact_release(layout: str) -> None:
    check_images_pinned(render(layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_manifest_holds_a_password(layout: str) -> None:
    check_no_password_literal(render(layout))


@pytest.mark.parametrize("check", TIER_CHECKS)
@pytest.mark.parametrize("layout", TIERS)
def test_routing_tier(layout: str, check: str) -> None:
    TIER_CHECKS[check](render(layout))


@pytest.mark.parametrize("check", STORE_CHECKS)
def test_routing_tier_store(check: str) -> None:
    STORE_CHECKS[check](render(STORE))


def test_routing_tier_inventory() -> None:
    docs = render(TIER)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("Deployment", "engine-chat"),
        ("Deployment", "engine-embed"),
        ("Deployment", "vllm-gateway"),
        ("HorizontalPodAutoscaler", "vllm-gateway"),
        ("Namespace", "vllm-gateway"),
        ("NetworkPolicy", "engines"),
        ("NetworkPolicy", "vllm-gateway"),
        ("PersistentVolumeClaim", "vllm-models"),
        ("PodDisruptionBudget", "vllm-gateway"),
        ("Service", "engine-chat"),
        ("Service", "engine-embed"),
        ("Service", "vllm-gateway"),
    ]
    # One engine workload per model, each serving a different one.
    models = [pod_template(w)["spec"]["containers"][0]["args"][0] for w in by_role(docs, "engine")]
    assert len(set(models)) == len(models) == 2
    # Several pods mount the weights at once, read-only.
    assert named(docs, "PersistentVolumeClaim", "vllm-models")["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]


def test_routing_tier_store_inventory() -> None:
    """The overlay adds the store, its Service, its policy and the gateways' way to it,
    and changes nothing of the tier but the gateways' store URL."""
    docs, tier = render(STORE), render(TIER)

    def key(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    added = sorted({key(d) for d in docs} - {key(d) for d in tier})
    assert added == [
        ("Deployment", "routing-store"),
        ("NetworkPolicy", "routing-store"),
        ("NetworkPolicy", "vllm-gateway-store"),
        ("Service", "routing-store"),
    ]
    assert {key(d) for d in tier} <= {key(d) for d in docs}
    gateway = _container(docs, "vllm-gateway", "gateway")
    gateway["env"] = [e for e in gateway["env"] if e["name"] != "GATEWAY_STORE_URL"]
    kept = sorted((d for d in docs if key(d) not in added), key=key)
    assert kept == sorted(tier, key=key)


def test_store_users_example() -> None:
    """The example ACL, for the example URL's user and the gateways' default prefix."""
    user = urlsplit(example_secrets()[("vllm-routing-store-url", "url")]).username
    assert user is not None
    check_store_users(example_secrets()[store_users_ref(render(STORE))], user, "vllm-gateway")


def _acl() -> str:
    return example_secrets()[("vllm-routing-store-users", "users.acl")]


# How the store's ACL file is broken; each must make check_store_users fail.
ACL_BREAKAGES: dict[str, Callable[[str], str]] = {
    "a clear password": lambda a: re.sub(r"#\S+", ">store-password", a),
    "a clear password besides the digest": lambda a: a.replace(" ~", " >pw ~"),
    "the gateways on every key": lambda a: a.replace("~vllm-gateway:*", "~*"),
    "the gateways on another prefix": lambda a: a.replace("~vllm-gateway:*", "~other:*"),
    "the gateways may CONFIG": lambda a: a.replace("+pexpire", "+pexpire +config"),
    "the gateways run every command": lambda a: a.replace("-@all +evalsha", "+@all"),
    "a grant that -@all takes back": lambda a: a.replace("-@all +evalsha", "+evalsha -@all"),
    "the gateways cannot load the script": lambda a: a.replace(" +script|load", ""),
    "the gateways without a password": lambda a: re.sub(r"#\S+", "nopass", a),
    "default may GET": lambda a: a.replace("-@all +ping\n", "-@all +ping +get\n", 1),
    "default on every channel": lambda a: a.replace("resetchannels", "&*", 1),
    "another user": lambda a: a + "user admin on #" + "0" * 64 + " +@all ~*\n",
    "the gateways' user renamed": lambda a: a.replace("user gateway", "user gateways"),
}


@pytest.mark.parametrize("case", ACL_BREAKAGES)
def test_store_users_check_catches_its_breakage(case: str) -> None:
    check_store_users(_acl(), "gateway", "vllm-gateway")  # passes as shipped
    broken = ACL_BREAKAGES[case](_acl())
    assert broken != _acl()
    with pytest.raises(AssertionError):
        check_store_users(broken, "gateway", "vllm-gateway")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize(
    "directory", [*(f"k8s/{x}" for x in LAYOUTS), *(f"monitoring/overlays/{x}" for x in LAYOUTS)]
)
def test_renderer_agrees_with_kubectl_kustomize(directory: str) -> None:
    """The tests' renderer gives what `kubectl kustomize` (kustomize built into kubectl,
    offline) gives, so the checks above see what a cluster would get: for each layout,
    and each with deploy/monitoring's components."""
    r = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / directory)], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr

    def key(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    theirs = sorted((d for d in yaml.safe_load_all(r.stdout) if d), key=key)
    assert theirs == sorted(kustomize(DEPLOY / directory), key=key)


# --- each check catches its breakage -------------------------------------------------------


def _container(docs: Docs, workload: str, name: str) -> dict[str, Any]:
    w = named(docs, "Deployment", workload)
    (c,) = [c for c in pod_template(w)["spec"]["containers"] if c["name"] == name]
    return c


def _pod(docs: Docs, workload: str) -> dict[str, Any]:
    w = named(docs, "Deployment", workload)
    spec: dict[str, Any] = pod_template(w)["spec"]
    return spec


def _set_env(c: dict[str, Any], name: str, value: str) -> None:
    e = env_var(c, name)
    assert e is not None
    e.clear()
    e.update({"name": name, "value": value})


def _store(docs: Docs) -> dict[str, Any]:
    return _container(docs, "routing-store", "redis")


def _store_arg(docs: Docs, option: str, value: str) -> None:
    args = _store(docs)["args"]
    args[args.index(option) + 1] = value


def _store_policy(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = named(docs, "NetworkPolicy", "routing-store")["spec"]
    return spec


def _engine_policy(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = named(docs, "NetworkPolicy", "engines")["spec"]
    return spec


def _gateway_engines(docs: Docs, entries: list[str]) -> None:
    _set_env(_container(docs, "vllm-gateway", "gateway"), "GATEWAY_ENGINES", json.dumps(entries))


CHAT = "dns+http://engine-chat.vllm-gateway.svc.cluster.local:8000"
STORE_URL = K8S_SECRETS[("vllm-routing-store-url", "url")]
EMBED = "dns+http://engine-embed.vllm-gateway.svc.cluster.local:8000"

# (layout, check, how the render is broken). Each must make its check fail.
BREAKAGES: dict[str, tuple[str, Callable[[Docs], None], Callable[[Docs], None]]] = {
    "schema: unknown field": (TIER, lambda d: check_schemas(d, K8S_VERSIONS[-1]),
        lambda d: _pod(d, "engine-chat").update(hostNetwrk=True)),
    "vllm runs as root (sidecar)": ("base", check_non_root,
        lambda d: _container(d, "vllm-gateway", "vllm")["securityContext"].update(runAsUser=0)),
    "vllm without runAsNonRoot": (TIER, check_non_root,
        lambda d: (_container(d, "engine-chat", "vllm")["securityContext"].pop("runAsNonRoot"),
                   _pod(d, "engine-chat")["securityContext"].pop("runAsNonRoot"))),
    "writable root (passthrough)": ("passthrough", check_non_root,
        lambda d: _container(d, "vllm-gateway", "vllm")["securityContext"].update(
            readOnlyRootFilesystem=False)),
    "a capability added": (TIER, check_non_root,
        lambda d: _container(d, "vllm-gateway", "gateway")["securityContext"].update(
            capabilities={"drop": ["ALL"], "add": ["NET_RAW"]})),
    "privilege escalation": (TIER, check_non_root,
        lambda d: _container(d, "engine-embed", "vllm")["securityContext"].update(
            allowPrivilegeEscalation=True)),
    "no seccomp profile": (TIER, check_non_root,
        lambda d: _pod(d, "vllm-gateway")["securityContext"].pop("seccompProfile")),
    "a hostPath volume": (TIER, check_non_root,
        lambda d: _pod(d, "engine-chat")["volumes"].append(
            {"name": "host", "hostPath": {"path": "/"}})),
    "models mounted writable": (TIER, check_non_root,
        lambda d: [m.pop("readOnly") for m in _container(d, "engine-chat", "vllm")["volumeMounts"]
                   if m["name"] == "models"]),
    "vllm home on the root fs": ("base", check_vllm_caches,
        lambda d: _set_env(_container(d, "vllm-gateway", "vllm"), "HOME", "/root")),
    "vllm home on the models volume": (TIER, check_vllm_caches,
        lambda d: _set_env(_container(d, "engine-embed", "vllm"), "HF_HOME", "/models/hf")),
    "engine key from another Secret": (TIER, check_upstream_key,
        lambda d: env_var(_container(d, "engine-embed", "vllm"), "VLLM_API_KEY")["valueFrom"]
        ["secretKeyRef"].update(name="other-key")),
    "gateway key written inline": (TIER, check_upstream_key,
        lambda d: _set_env(_container(d, "vllm-gateway", "gateway"), "GATEWAY_UPSTREAM_API_KEY",
                           UPSTREAM)),
    "engine key on the command line": ("base", check_upstream_key,
        lambda d: _container(d, "vllm-gateway", "vllm")["args"].append("--api-key=x")),
    "namespace secret unset (sidecar)": ("base", check_namespace_secret,
        lambda d: _container(d, "vllm-gateway", "gateway")["env"].remove(
            env_var(_container(d, "vllm-gateway", "gateway"), NAMESPACE_ENV))),
    "namespace secret written inline": (TIER, check_namespace_secret,
        lambda d: _set_env(_container(d, "vllm-gateway", "gateway"), NAMESPACE_ENV,
                           NAMESPACE_SECRET)),
    "namespace secret from a Secret the example lacks": (STORE, check_namespace_secret,
        lambda d: env_var(_container(d, "vllm-gateway", "gateway"), NAMESPACE_ENV)
        ["valueFrom"]["secretKeyRef"].update(name="other-namespace")),
    "gateways read different namespace secrets": ("passthrough", check_namespace_secret,
        lambda d: pod_template(named(d, "Deployment", "vllm-gateway"))["spec"]["containers"]
        .append({**_container(d, "vllm-gateway", "gateway"), "name": "gateway-2", "env": [
            {"name": NAMESPACE_ENV, "valueFrom": {"secretKeyRef": {
                "name": "vllm-gateway-namespace-2", "key": "secret"}}}]})),
    "engine on loopback": (TIER, check_engines_listen_on_the_pod_ip,
        lambda d: _container(d, "engine-chat", "vllm")["args"].__setitem__(1, "--host=127.0.0.1")),
    "POD_IP undefined": (TIER, check_engines_listen_on_the_pod_ip,
        lambda d: _container(d, "engine-embed", "vllm")["env"].pop(0)),
    "ingress from any namespace": (TIER, check_engine_fence,
        lambda d: _engine_policy(d)["ingress"][0]["from"].append({"namespaceSelector": {}})),
    "ingress rule without from": (TIER, check_engine_fence,
        lambda d: _engine_policy(d)["ingress"][0].pop("from")),
    "ingress from the engines themselves": (TIER, check_engine_fence,
        lambda d: _engine_policy(d)["ingress"][0]["from"][0]["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "engine"})),
    "ingress on another port": (TIER, check_engine_fence,
        lambda d: _engine_policy(d)["ingress"][0]["ports"][0].update(port=8080)),
    "engine egress allowed": (TIER, check_engine_fence,
        lambda d: _engine_policy(d).update(egress=[{}])),
    "policy selects no engine": (TIER, check_engine_fence,
        lambda d: _engine_policy(d)["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "engines"})),
    "a second policy opens the engines": (TIER, check_engine_fence,
        lambda d: d.append({"kind": "NetworkPolicy", "metadata": {"name": "open"},
                            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
                                     "ingress": [{}], "egress": []}})),
    "gateways cannot reach engines": (TIER, check_engine_fence,
        lambda d: named(d, "NetworkPolicy", "vllm-gateway")["spec"]["egress"].pop(1)),
    "entry names a missing Service": (TIER, check_discovery,
        lambda d: _gateway_engines(d, [CHAT.replace("engine-chat", "engine-chats"), EMBED])),
    "entry in another namespace": (TIER, check_discovery,
        lambda d: _gateway_engines(d, [CHAT.replace(".vllm-gateway.", ".default."), EMBED])),
    "entry on another port": (TIER, check_discovery,
        lambda d: _gateway_engines(d, [CHAT.replace(":8000", ":8001"), EMBED])),
    "an engine no entry finds": (TIER, check_discovery,
        lambda d: _gateway_engines(d, [CHAT])),
    "a plain URL in place of dns+http": (TIER, check_discovery,
        lambda d: _gateway_engines(d, [CHAT.removeprefix("dns+"), EMBED])),
    "engine Service not headless": (TIER, check_discovery,
        lambda d: named(d, "Service", "engine-embed")["spec"].pop("clusterIP")),
    "autoscaler on another Deployment": (TIER, check_gateway_scaling,
        lambda d: of_kind(d, "HorizontalPodAutoscaler")[0]["spec"]["scaleTargetRef"].update(
            name="engine-chat")),
    "autoscaler down to one": (TIER, check_gateway_scaling,
        lambda d: of_kind(d, "HorizontalPodAutoscaler")[0]["spec"].update(minReplicas=1)),
    "one gateway": (TIER, check_gateway_scaling,
        lambda d: named(d, "Deployment", "vllm-gateway")["spec"].update(replicas=1)),
    "budget on the engines": (TIER, check_gateway_scaling,
        lambda d: of_kind(d, "PodDisruptionBudget")[0]["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "engine"})),
    "no CPU request": (TIER, check_gateway_scaling,
        lambda d: _container(d, "vllm-gateway", "gateway")["resources"]["requests"].pop("cpu")),
    "readiness on /healthz": (TIER, check_gateway_probes,
        lambda d: _container(d, "vllm-gateway", "gateway")["readinessProbe"]["httpGet"].update(
            path="/healthz")),
    "liveness on the engine port": (TIER, check_gateway_probes,
        lambda d: _container(d, "vllm-gateway", "gateway")["livenessProbe"]["httpGet"].update(
            port=8000)),
    "namespace not restricted": (TIER, check_namespace_is_restricted,
        lambda d: of_kind(d, "Namespace")[0]["metadata"]["labels"].update(
            {"pod-security.kubernetes.io/enforce": "baseline"})),
    "store out of the namespace": (STORE, check_namespace_is_restricted,
        lambda d: named(d, "Deployment", "routing-store")["metadata"].update(namespace="default")),
    "gateway image latest": (TIER, check_images_pinned,
        lambda d: _container(d, "vllm-gateway", "gateway").update(image="vllm-gateway:latest")),
    "store image by a floating tag": (STORE, check_images_pinned,
        lambda d: _store(d).update(image="redis:7.4-alpine")),
    "store: schema, unknown field": (STORE, lambda d: check_schemas(d, K8S_VERSIONS[0]),
        lambda d: _store(d)["securityContext"].update(readOnlyRootFilesysten=True)),
    "store runs as root": (STORE, check_non_root,
        lambda d: (_store(d)["securityContext"].update(runAsUser=0))),
    "store writable root": (STORE, check_non_root,
        lambda d: _store(d)["securityContext"].update(readOnlyRootFilesystem=False)),
    "store keeps a capability": (STORE, check_non_root,
        lambda d: _store(d)["securityContext"].update(capabilities={"drop": ["NET_RAW"]})),
    "store gets the API token": (STORE, check_non_root,
        lambda d: _pod(d, "routing-store").update(automountServiceAccountToken=True)),
    "store older than the Lua fix": (STORE, check_store,
        lambda d: _store(d).update(image="redis:7.4.8-alpine")),
    "two stores": (STORE, check_store,
        lambda d: named(d, "Deployment", "routing-store")["spec"].update(replicas=2)),
    "store in a rolling update": (STORE, check_store,
        lambda d: named(d, "Deployment", "routing-store")["spec"].update(
            strategy={"type": "RollingUpdate"})),
    "store appends to a file": (STORE, check_store,
        lambda d: _store_arg(d, "--appendonly", "yes")),
    "store saves snapshots": (STORE, check_store,
        lambda d: _store_arg(d, "--save", "3600 1")),
    "store password on the command line": (STORE, check_store,
        lambda d: _store(d)["args"].extend(["--requirepass", "x"])),
    "store password in a variable": (STORE, check_store,
        lambda d: _store(d).update(env=[{"name": "REDIS_PASSWORD", "value": "x"}])),
    "store users on the root filesystem": (STORE, check_store,
        lambda d: _store_arg(d, "--aclfile", "/etc/redis.acl")),
    "store users mounted writable": (STORE, check_store,
        lambda d: [m.pop("readOnly") for m in _store(d)["volumeMounts"] if m["name"] == "users"]),
    "store users from a Secret the example lacks": (STORE, check_store,
        lambda d: _pod(d, "routing-store")["volumes"][0]["secret"].update(secretName="other")),
    "store evicts past its limit": (STORE, check_store,
        lambda d: _store_arg(d, "--maxmemory", "1gb")),
    "store never evicts": (STORE, check_store,
        lambda d: _store_arg(d, "--maxmemory-policy", "noeviction")),
    "store probe on another port": (STORE, check_store,
        lambda d: _store(d)["livenessProbe"]["exec"]["command"].__setitem__(2, "6380")),
    "store ingress from the engines": (STORE, check_store_fence,
        lambda d: _store_policy(d)["ingress"][0]["from"].append(
            {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}}})),
    "store ingress from any namespace": (STORE, check_store_fence,
        lambda d: _store_policy(d)["ingress"][0]["from"].append({"namespaceSelector": {}})),
    "store ingress rule without from": (STORE, check_store_fence,
        lambda d: _store_policy(d)["ingress"][0].pop("from")),
    "store ingress on another port": (STORE, check_store_fence,
        lambda d: _store_policy(d)["ingress"][0]["ports"][0].update(port=6380)),
    "store egress allowed": (STORE, check_store_fence,
        lambda d: _store_policy(d).update(egress=[{}])),
    "store policy selects nothing": (STORE, check_store_fence,
        lambda d: _store_policy(d)["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "redis"})),
    "a second policy opens the store": (STORE, check_store_fence,
        lambda d: d.append({"kind": "NetworkPolicy", "metadata": {"name": "open"},
                            "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                                     "ingress": [{}]}})),
    "gateways cannot reach the store": (STORE, check_store_fence,
        lambda d: d.remove(named(d, "NetworkPolicy", "vllm-gateway-store"))),
    "gateways reach the store on another port": (STORE, check_store_fence,
        lambda d: named(d, "NetworkPolicy", "vllm-gateway-store")["spec"]["egress"][0][
            "ports"][0].update(port=6380)),
    "store URL unset": (STORE, check_store_url,
        lambda d: _container(d, "vllm-gateway", "gateway")["env"].remove(
            env_var(_container(d, "vllm-gateway", "gateway"), "GATEWAY_STORE_URL"))),
    "store URL written inline": (STORE, check_store_url,
        lambda d: _set_env(_container(d, "vllm-gateway", "gateway"), "GATEWAY_STORE_URL",
                           STORE_URL)),
    "store URL from a Secret the example lacks": (STORE, check_store_url,
        lambda d: env_var(_container(d, "vllm-gateway", "gateway"), "GATEWAY_STORE_URL")
        ["valueFrom"]["secretKeyRef"].update(name="other-url")),
    "store URL names a missing Service": (STORE, check_store_url,
        lambda d: named(d, "Service", "routing-store")["metadata"].update(name="redis")),
    "store Service on another port": (STORE, check_store_url,
        lambda d: named(d, "Service", "routing-store")["spec"]["ports"][0].update(port=6380)),
    "store Service headless": (STORE, check_store_url,
        lambda d: named(d, "Service", "routing-store")["spec"].update(clusterIP="None")),
    "store Service selects the gateways": (STORE, check_store_url,
        lambda d: named(d, "Service", "routing-store")["spec"]["selector"].update(
            {"app.kubernetes.io/component": "gateway"})),
    "gateways on another key prefix": (STORE, check_store_url,
        lambda d: _container(d, "vllm-gateway", "gateway")["env"].append(
            {"name": "GATEWAY_STORE_PREFIX", "value": "tier-a"})),
    "literal: requirepass": (STORE, check_no_password_literal,
        lambda d: _store(d)["args"].extend(["--requirepass", "x"])),
    "literal: the store URL inline": (STORE, check_no_password_literal,
        lambda d: _set_env(_container(d, "vllm-gateway", "gateway"), "GATEWAY_STORE_URL",
                           STORE_URL)),
    "literal: a password variable": (STORE, check_no_password_literal,
        lambda d: _store(d).update(env=[{"name": "REDISCLI_AUTH", "value": "x"}])),
    "literal: an ACL in a ConfigMap": (STORE, check_no_password_literal,
        lambda d: d.append({"kind": "ConfigMap", "metadata": {"name": "users"},
                            "data": {"users.acl": "user gateway on #" + "ab" * 32 + " ~*"}})),
    "literal: a URL with a password in args": ("base", check_no_password_literal,
        lambda d: _container(d, "vllm-gateway", "gateway").update(
            args=["--config", "redis://:pw@store:6379/0"])),
}  # fmt: skip


@pytest.mark.parametrize("case", BREAKAGES)
def test_each_check_catches_its_breakage(case: str) -> None:
    layout, check, breaks = BREAKAGES[case]
    docs = render(layout)
    check(docs)  # passes as shipped
    breaks(docs)
    with pytest.raises(AssertionError):
        check(docs)


# --- the routing tier as processes -----------------------------------------------------------


def key_file(tmp: Path) -> Path:
    r = run_cli("hash-key", stdin=CLIENT_KEY + "\n")
    assert r.returncode == 0, r.stderr
    path = tmp / "keys.yaml"
    path.write_text(f"api_keys:\n  - key: {r.stdout.strip()}\n    name: routing-tier-test\n")
    return path


def sim_from_manifest(tmp: Path, workload: dict[str, Any]) -> Proc:
    """The simulated engine with the manifest's model, runner, key and media list."""
    (c,) = pod_template(workload)["spec"]["containers"]
    args, env = c["args"], k8s_env(c)
    opts = ["--model", args[0], "--api-key", env["VLLM_API_KEY"]]
    if runner := flag_values(args, "--runner"):
        opts += ["--runner", *runner]
    opts += ["--allowed-media-domains", *(flag_values(args, "--allowed-media-domains") or [])]
    return sim_proc(tmp, *opts)


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One gateway with the routing tier's settings, each of its `dns+http://` entries
    pointed at `localhost` on the port of a simulated engine started from the workload
    behind that entry's Service."""
    tmp = tmp_path_factory.mktemp("routing-tier")
    docs = render(TIER)
    sims, entries = {}, []
    for entry in dns_entries(docs):
        svc = named(docs, "Service", entry.host.split(".")[0])
        (workload,) = [w for w in by_role(docs, "engine")
                       if selects({"matchLabels": svc["spec"]["selector"]},
                                  pod_template(w)["metadata"]["labels"])]  # fmt: skip
        sims[workload["metadata"]["name"]] = sim = sim_from_manifest(tmp, workload)
        entries.append(f"dns+http://localhost:{sim.port}")
    (_, gateway_c), *_ = gateway_containers(docs)
    env = k8s_env(gateway_c)
    env["GATEWAY_ENGINES"] = json.dumps(entries)
    env["GATEWAY_API_KEYS_FILE"] = str(key_file(tmp))
    gateway = gateway_proc(tmp, env)
    with running(*sims.values()), running(gateway, ready_path="/healthz"):
        yield {"gateway": gateway, "sims": sims, "container": gateway_c}


@pytest.mark.slow
def test_the_tier_gateway_turns_ready_with_every_engine_and_its_probes_answer(
    tier: dict[str, Any],
) -> None:
    """Ready requires an engine's /v1/models, which the engines serve only with the
    upstream key: every engine counted healthy proves the gateway sends the key the
    engine manifests require."""
    url, c = tier["gateway"].url, tier["container"]

    def all_healthy() -> bool:
        r = HTTP.get(url + c["readinessProbe"]["httpGet"]["path"], timeout=5)
        return r.status_code == 200 and r.json()["healthy_engines"] == len(tier["sims"])

    assert wait_for(all_healthy, 30), tier["gateway"].log()
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert container_port(c, get["port"]) == GATEWAY_PORT
        assert HTTP.get(url + get["path"], timeout=5).status_code == 200, probe
    # A path the gateway does not serve is no probe: it answers 404, not 200.
    assert HTTP.get(url + "/ready", timeout=5).status_code == 404


@pytest.mark.slow
def test_the_tier_gateway_serves_keyed_clients_only(tier: dict[str, Any]) -> None:
    url = tier["gateway"].url
    r = HTTP.get(url + "/v1/models", timeout=5)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = HTTP.get(url + "/v1/models", headers={"Authorization": f"Bearer {UPSTREAM}"}, timeout=5)
    assert r.status_code == 401, "the engines' key is not a client key"
    r = HTTP.get(url + "/v1/models", headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=5)
    assert r.status_code == 200, r.text
    log = tier["gateway"].log()
    assert UPSTREAM not in log and CLIENT_KEY not in log
