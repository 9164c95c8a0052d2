"""deploy/: the image, the compose stack and the Kubernetes manifests.

No container runtime here: the files are parsed and their properties checked, the gateway
settings they carry are loaded by the real `Settings` and `check-config`, and the stack
they describe is run as processes on loopback (the simulated engine with the compose
command, the gateway with the compose and Kubernetes environments, the image's
HEALTHCHECK and the engine's probe commands).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import BaseModel

from bench.harness.metrics import HTTP
from bench.harness.samples import data_url, png
from gateway.config.key_file import load_key_file
from gateway.config.settings import Settings, load_settings
from tests.deploy.manifests import (
    DEPLOY,
    K8S,
    NAMESPACE_SECRET,
    STORE_PASSWORD,
    UPSTREAM,
    flag_values,
    k8s_env,
    load_all,
    named,
    render,
)
from tests.procs import (
    ROOT,
    Proc,
    RecordingServer,
    free_port,
    gateway_proc,
    run_cli,
    running,
    sim_proc,
    sim_received,
    wait_for,
)

DOCKERFILE = DEPLOY / "Dockerfile"
CLIENT_KEY = "sk-deploy-test-0123456789abcdef"
# What the operator supplies through deploy/.env (compose) or Secrets (Kubernetes).
COMPOSE_VARS = {"UPSTREAM_API_KEY": UPSTREAM, "NAMESPACE_SECRET": NAMESPACE_SECRET}
VARIANTS = ("compose", "k8s-base", "k8s-passthrough")
# Where a gateway is configured: the stack's variants and the routing tier's gateways,
# without and with the shared placement store.
GATEWAY_VARIANTS = (*VARIANTS, "k8s-routing-tier", "k8s-routing-tier-store")
# Where a vLLM runs: (variant, workload) for the Kubernetes ones.
ENGINES = (
    ("compose", None),
    ("k8s-base", "vllm-gateway"),
    ("k8s-passthrough", "vllm-gateway"),
    ("k8s-routing-tier", "engine-chat"),
    ("k8s-routing-tier", "engine-embed"),
)
TRUE = ("1", "true", "yes", "on")


# --- reading the files -----------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


@cache
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's `${NAME}`, `${NAME:-default}` and `${NAME:?error}` (enough for our files)."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op and op.endswith("?"):
            raise KeyError(f"compose requires {name}: {arg}")
        return arg or ""

    return _VAR.sub(one, value)


def compose_service(name: str) -> dict[str, Any]:
    service: dict[str, Any] = compose()["services"][name]
    return service


def compose_env(name: str, env: Mapping[str, str] = COMPOSE_VARS) -> dict[str, str]:
    raw = compose_service(name).get("environment", {})
    assert isinstance(raw, dict), "environment as a mapping"
    return {k: interpolate(str(v), env) for k, v in raw.items()}


def compose_command(name: str, env: Mapping[str, str] = COMPOSE_VARS) -> list[str]:
    return [interpolate(str(a), env) for a in compose_service(name)["command"]]


def k8s(variant: str) -> list[dict[str, Any]]:
    return render(variant.removeprefix("k8s-"))


def k8s_one(variant: str, kind: str) -> dict[str, Any]:
    found = [d for d in k8s(variant) if d["kind"] == kind]
    assert len(found) == 1, f"one {kind} in {variant}"
    return found[0]


def pod_spec(variant: str, workload: str = "vllm-gateway") -> dict[str, Any]:
    """The pod of a Deployment: the sidecar pod, or the gateways of the routing tier."""
    spec: dict[str, Any] = named(k8s(variant), "Deployment", workload)["spec"]["template"]["spec"]
    return spec


def container(variant: str, name: str, workload: str = "vllm-gateway") -> dict[str, Any]:
    (found,) = [c for c in pod_spec(variant, workload)["containers"] if c["name"] == name]
    return found


def gateway_env(variant: str) -> dict[str, str]:
    if variant == "compose":
        return compose_env("gateway")
    return k8s_env(container(variant, "gateway"))


def is_setting(env_name: str) -> bool:
    """Whether `GATEWAY_A__B` names a field of Settings (nested models followed by `__`).

    The deploy files are checked by name here, as `load_settings` checks the
    environment (test_unknown_env_names_are_refused)."""
    if not env_name.startswith("GATEWAY_"):
        return False
    model: type[BaseModel] | None = Settings
    for part in env_name.removeprefix("GATEWAY_").lower().split("__"):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return True


def clean_environ() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GATEWAY_") and k != "VLLM_GATEWAY_CONFIG"
    }


@cache
def client_key_digest() -> str:
    """`vllm-gateway hash-key`'s digest of the client key, run once per session (a
    process that imports the gateway: a second apiece, ten times in this module)."""
    result = run_cli("hash-key", stdin=CLIENT_KEY + "\n")
    assert result.returncode == 0, result.stderr
    digest = result.stdout.strip()
    assert digest.startswith("sha256:") and CLIENT_KEY not in digest
    return digest


def key_file(tmp: Path) -> Path:
    """A keys file as the operator makes it: digests from `vllm-gateway hash-key`."""
    digest = client_key_digest()
    path = tmp / "keys.yaml"
    path.write_text(f"api_keys:\n  - key: {digest}\n    name: deploy-test\n")
    return path


# --- the files parse --------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs and all(isinstance(d, dict) for d in docs)
    if path.is_relative_to(K8S):
        for d in docs:
            assert d.get("apiVersion") and d.get("kind"), path


def test_the_overlays_render_every_manifest() -> None:
    kinds = {d["kind"] for d in k8s("k8s-base")}
    assert kinds == {"Deployment", "Service", "NetworkPolicy", "PersistentVolumeClaim"}
    assert {d["kind"] for d in k8s("k8s-passthrough")} == kinds
    # Placeholder secrets are never applied with the manifests.
    assert all(d["kind"] != "Secret" for v in ("k8s-base", "k8s-passthrough") for d in k8s(v))


# --- gateway settings named by the deploy files -------------------------------------------


def test_unknown_env_names_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt variable in a deploy file would stop the gateway at start."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GATEWAY_ALLOW_UNAUTHENTICATED", "true")
    monkeypatch.setenv("GATEWAY_MEDIA_MODE", "passthrough")  # one `_` short
    with pytest.raises(ValueError, match="GATEWAY_MEDIA_MODE: unknown setting"):
        load_settings()
    assert not is_setting("GATEWAY_MEDIA_MODE")
    assert not is_setting("GATEWAY_MEDIA__MODES")
    assert not is_setting("GATEWAY_LIMITS__MAX_BODY_BYTES__X")
    assert not is_setting("VLLM_API_KEY")
    assert is_setting("GATEWAY_MEDIA__MODE") and is_setting("GATEWAY_UPSTREAM_API_KEY")


@pytest.mark.parametrize("variant", GATEWAY_VARIANTS)
def test_every_gateway_env_name_is_a_setting(variant: str) -> None:
    env = gateway_env(variant)
    assert env, variant
    unknown = sorted(n for n in env if n.startswith("GATEWAY_") and not is_setting(n))
    assert unknown == []
    # Nothing but settings (and no stray variable the gateway would never read).
    assert all(n.startswith("GATEWAY_") for n in env)


@pytest.mark.slow
@pytest.mark.parametrize("variant", GATEWAY_VARIANTS)
def test_gateway_env_loads_as_settings(
    variant: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    env = gateway_env(variant)
    # The key file is read when the settings load: the container's path is not here.
    env["GATEWAY_API_KEYS_FILE"] = str(key_file(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = Settings()
    assert s.upstream_api_key is not None
    assert s.upstream_api_key.get_secret_value() == UPSTREAM
    assert s.api_keys_file is not None and s.api_keys == []
    assert not s.allow_unauthenticated and not s.public_metrics
    # One namespace secret from the operator (a Secret, or .env): never generated, so
    # ids made through one replica, or before a restart, read the same on the others.
    assert s.payload.namespace_secret is not None
    assert s.payload.namespace_secret.get_secret_value() == NAMESPACE_SECRET
    # The sidecar's own engine; the routing tier's two models' headless Services.
    assert len(s.engines) == (2 if variant.startswith("k8s-routing-tier") else 1)
    # The store's URL, password included, from its Secret; only with the store.
    store_url = s.store_url
    if variant == "k8s-routing-tier-store":
        assert store_url is not None and STORE_PASSWORD in store_url.get_secret_value()
        assert STORE_PASSWORD not in repr(s)
    else:
        assert store_url is None
    expected = "passthrough" if variant == "k8s-passthrough" else "inline"
    assert s.media.mode == expected
    assert s.media.allowed_schemes == ["https"]
    assert s.media.allowed_networks == []


@pytest.mark.slow
@pytest.mark.parametrize("variant", GATEWAY_VARIANTS)
def test_check_config_accepts_the_deploy_env(variant: str, tmp_path: Path) -> None:
    env = {**clean_environ(), **gateway_env(variant)}
    env["GATEWAY_API_KEYS_FILE"] = str(key_file(tmp_path))
    r = run_cli("check-config", env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    # Masked by the settings' own dump (SecretStr), since check-config prints it as is.
    assert data["upstream_api_key"] == "**********"
    assert UPSTREAM not in r.stdout + r.stderr
    assert STORE_PASSWORD not in r.stdout + r.stderr
    assert NAMESPACE_SECRET not in r.stdout + r.stderr
    assert data["payload"]["namespace_secret"] == "**********"
    assert "namespace_secret_generated" not in r.stderr
    if variant == "k8s-routing-tier-store":
        assert data["store_url"] == "**********"


def test_compose_env_fails_without_the_upstream_key() -> None:
    with pytest.raises(KeyError, match="UPSTREAM_API_KEY"):
        compose_env("gateway", env={})
    with pytest.raises(KeyError, match="UPSTREAM_API_KEY"):
        compose_env("engine", env={})


def test_compose_env_fails_without_the_namespace_secret() -> None:
    """The gateway's namespace secret comes from .env, with no default: compose refuses
    to start without it rather than let the gateway generate one per start."""
    with pytest.raises(KeyError, match="NAMESPACE_SECRET"):
        compose_env("gateway", env={"UPSTREAM_API_KEY": UPSTREAM})
    raw = compose_service("gateway")["environment"]["GATEWAY_PAYLOAD__NAMESPACE_SECRET"]
    assert raw.startswith("${NAMESPACE_SECRET:?")


# --- compose ----------------------------------------------------------------------------


ENGINE_SERVICES = ("engine", "engine-sim")


@pytest.mark.parametrize("name", ENGINE_SERVICES)
def test_compose_engine_publishes_no_port_and_has_no_route_out(name: str) -> None:
    service = compose_service(name)
    assert "ports" not in service and "network_mode" not in service
    networks = service["networks"]
    assert set(networks) == {"engines"}
    assert compose()["networks"]["engines"]["internal"] is True
    # The gateway reaches either engine under one name.
    aliases = (
        (networks.get("engines") or {}).get("aliases", []) if isinstance(networks, dict) else []
    )
    assert name == "engine" or "engine" in aliases
    assert compose_env("gateway")["GATEWAY_ENGINES"] == '["http://engine:8000"]'
    assert flag_values(compose_command(name), "--port") == ["8000"]


def test_compose_gateway_publishes_8080_and_bridges_the_networks() -> None:
    gateway = compose_service("gateway")
    (port,) = gateway["ports"]
    host_ip, published, target = interpolate(port, {}).rsplit(":", 2)
    assert (published, target) == ("8080", "8080")
    assert host_ip == "127.0.0.1"  # the host's loopback unless the operator says otherwise
    assert set(gateway["networks"]) == {"edge", "engines"}
    assert compose()["networks"]["edge"].get("internal") is not True


def test_compose_gateway_is_hardened_and_reads_keys_from_a_read_only_file() -> None:
    gateway = compose_service("gateway")
    assert gateway["read_only"] is True
    assert gateway["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in gateway["security_opt"]
    uid = str(gateway["user"]).split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    # Compose mounts secrets read-only at /run/secrets/<name>.
    assert gateway["secrets"] == ["gateway_keys"]
    assert compose_env("gateway")["GATEWAY_API_KEYS_FILE"] == "/run/secrets/gateway_keys"
    assert compose()["secrets"]["gateway_keys"]["file"] == "./keys.yaml"
    assert "keys.yaml" in (DEPLOY / ".gitignore").read_text().split()
    assert "GATEWAY_API_KEYS" not in compose_env("gateway")  # no plain keys in the env


# The one service that keeps its image's root user: it writes into a fresh named volume,
# which Docker creates owned by root (deploy/README.md, "Compose").
COMPOSE_ROOT_ALLOWED = {"model-download"}


def check_compose_non_root(doc: dict[str, Any]) -> None:
    """Every service but the download runs as a numeric non-root user on a read-only
    root; all drop every capability and cannot escalate. vLLM's home is a tmpfs and its
    weights a read-only mount."""
    for name, service in doc["services"].items():
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        if name in COMPOSE_ROOT_ALLOWED:
            continue
        uid, _, gid = str(service.get("user", "")).partition(":")
        assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0, name
        assert service.get("read_only") is True, name
    engine = doc["services"]["engine"]
    env = engine["environment"]
    tmpfs = [t.split(":")[0] for t in engine.get("tmpfs", [])]
    assert env["HOME"] in tmpfs and "/tmp" in tmpfs
    assert env["HF_HOME"].startswith(env["HOME"] + "/") and env.get("USER")
    (volume,) = engine["volumes"]
    source, target, *mode = volume.split(":")
    assert env["HF_HUB_CACHE"].startswith(target + "/") and mode == ["ro"]
    download = doc["services"]["model-download"]
    # The download fills the same volume, at the path the engine reads snapshots from.
    assert download["volumes"] == [f"{source}:{target}"]
    assert download["environment"]["HF_HOME"] + "/hub" == env["HF_HUB_CACHE"]


def test_compose_services_run_non_root() -> None:
    check_compose_non_root(copy.deepcopy(compose()))


@pytest.mark.parametrize(
    "breaks",
    [
        lambda d: d["services"]["engine"].pop("user"),
        lambda d: d["services"]["engine"].update(user="0:0"),
        lambda d: d["services"]["engine-sim"].update(read_only=False),
        lambda d: d["services"]["model-download"].pop("cap_drop"),
        lambda d: d["services"]["engine"]["environment"].update(HOME="/root"),
        lambda d: d["services"]["engine"].update(volumes=["hf-cache:/models"]),
    ],
    ids=["no user", "root", "writable root", "capabilities", "home", "writable weights"],
)
def test_compose_non_root_check_catches(breaks: Any) -> None:
    doc = copy.deepcopy(compose())
    breaks(doc)
    with pytest.raises(AssertionError):
        check_compose_non_root(doc)


def test_compose_engine_flags() -> None:
    engine = compose_service("engine")
    env = compose_env("engine")
    args = compose_command("engine")
    # The key the gateway sends is the one the engine requires.
    assert env["VLLM_API_KEY"] == compose_env("gateway")["GATEWAY_UPSTREAM_API_KEY"] == UPSTREAM
    assert UPSTREAM not in " ".join(args)  # not on the command line
    assert flag_values(args, "--host") == ["0.0.0.0"]  # of its own container, on `engines`
    gpus = engine["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert env["HF_HUB_OFFLINE"] == "1"  # `engines` has no route to the hub
    assert set(compose_service("model-download")["networks"]) == {"edge"}
    assert compose_service("model-download")["profiles"] == ["download"]
    # The simulated engine takes the same key.
    sim_args = compose_command("engine-sim")
    assert flag_values(sim_args, "--api-key") == [UPSTREAM]
    assert compose_service("engine")["profiles"] == ["gpu"]
    assert compose_service("engine-sim")["profiles"] == ["sim"]


# --- vLLM flags, everywhere an engine runs ---------------------------------------------


def engine_env_and_args(where: str, workload: str | None) -> tuple[dict[str, str], list[str]]:
    if where == "compose":
        return compose_env("engine"), compose_command("engine")
    assert workload is not None
    c = container(where, "vllm", workload)
    assert c["command"] == ["vllm", "serve"]
    return k8s_env(c), list(c["args"])


@pytest.mark.parametrize(("where", "workload"), ENGINES)
def test_vllm_runs_with_safe_flags(where: str, workload: str | None) -> None:
    env, args = engine_env_and_args(where, workload)
    assert env["VLLM_API_KEY"] == UPSTREAM
    assert flag_values(args, "--api-key") is None  # the env var keeps it out of `ps`
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    assert env.get("VLLM_SERVER_DEV_MODE", "0").lower() not in TRUE
    assert env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").lower() not in TRUE
    for flag in (
        "--allowed-local-media-path",
        "--trust-remote-code",
        "--enable-mm-embeds",
        "--enable-prompt-embeds",
        "--enable-lora",
        "--enable-tokenizer-info-endpoint",
    ):
        assert flag_values(args, flag) is None, flag
    domains = flag_values(args, "--allowed-media-domains")
    assert domains, "an empty list would let vLLM fetch from any host"
    if where != "k8s-passthrough":
        # Inline: the engine gets data: URLs only, so no host needs to be allowed.
        assert domains == ["media.invalid"]


# --- Kubernetes ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["k8s-base", "k8s-passthrough"])
def test_k8s_vllm_listens_on_loopback_and_only_the_gateway_is_exposed(variant: str) -> None:
    vllm = container(variant, "vllm")
    assert flag_values(vllm["args"], "--host") == ["127.0.0.1"]
    assert "ports" not in vllm
    spec = pod_spec(variant)
    assert not spec.get("hostNetwork") and not spec.get("hostPID")
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    gateway_ports = container(variant, "gateway")["ports"]
    assert gateway_ports == [{"name": "http", "containerPort": 8080}]
    service = k8s_one(variant, "Service")["spec"]
    assert service.get("type", "ClusterIP") == "ClusterIP"
    assert service["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    assert gateway_env(variant)["GATEWAY_ENGINES"] == '["http://127.0.0.1:8000"]'
    assert flag_values(vllm["args"], "--port") == ["8000"]


@pytest.mark.parametrize("variant", ["k8s-base", "k8s-passthrough"])
def test_k8s_gateway_runs_non_root_on_a_read_only_root(variant: str) -> None:
    gateway = container(variant, "gateway")
    sc = gateway["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc
    # The only writable place is an emptyDir at /tmp; keys are a read-only Secret mount.
    mounts = {m["mountPath"]: m for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(variant)["volumes"]}
    writable = [p for p, m in mounts.items() if not m.get("readOnly")]
    assert writable == ["/tmp"] and "emptyDir" in volumes[mounts["/tmp"]["name"]]
    vllm_sc = container(variant, "vllm")["securityContext"]
    assert vllm_sc["allowPrivilegeEscalation"] is False
    assert vllm_sc["capabilities"] == {"drop": ["ALL"]}


def test_k8s_probes_resources_and_secrets() -> None:
    gateway = container("k8s-base", "gateway")
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    for c in pod_spec("k8s-base")["containers"]:
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
    assert container("k8s-base", "vllm")["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Every Secret the pod reads exists in the example, under the same key.
    secrets = {
        d["metadata"]["name"]: d["stringData"] for d in load_all(K8S / "secrets.example.yaml")
    }
    for c in pod_spec("k8s-base")["containers"]:
        for e in c.get("env", []):
            if "valueFrom" in e:
                ref = e["valueFrom"]["secretKeyRef"]
                assert ref["key"] in secrets[ref["name"]], e["name"]
    # The keys file path is the Secret's key under its directory mount (no subPath, so
    # Kubernetes updates it in place and the gateway reloads it).
    (mount,) = [m for m in gateway["volumeMounts"] if m["name"] == "keys"]
    assert "subPath" not in mount and mount["readOnly"] is True
    (volume,) = [v for v in pod_spec("k8s-base")["volumes"] if v["name"] == "keys"]
    path = Path(gateway_env("k8s-base")["GATEWAY_API_KEYS_FILE"])
    assert path.parent == Path(mount["mountPath"])
    assert path.name in secrets[volume["secret"]["secretName"]]
    example_keys = yaml.safe_load(secrets["vllm-gateway-keys"]["keys.yaml"])
    assert example_keys == {"api_keys": []}  # the placeholder lets nobody in


def test_example_key_files_load_and_let_nobody_in(tmp_path: Path) -> None:
    assert load_key_file(DEPLOY / "keys.example.yaml") == ()
    (secret,) = [
        d
        for d in load_all(K8S / "secrets.example.yaml")
        if d["metadata"]["name"] == "vllm-gateway-keys"
    ]
    path = tmp_path / "keys.yaml"
    path.write_text(secret["stringData"]["keys.yaml"])
    assert load_key_file(path) == ()


def test_k8s_network_policy_allows_dns_and_public_https_only() -> None:
    policy = k8s_one("k8s-base", "NetworkPolicy")["spec"]
    labels = k8s_one("k8s-base", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    (ingress,) = policy["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 8080}]  # never vLLM's 8000
    dns, https = policy["egress"]
    assert sorted((p["protocol"], p["port"]) for p in dns["ports"]) == [("TCP", 53), ("UDP", 53)]
    assert all("ipBlock" not in t for t in dns["to"])  # DNS only to the cluster's resolver
    assert https["ports"] == [{"protocol": "TCP", "port": 443}]
    blocks = {t["ipBlock"]["cidr"]: set(t["ipBlock"]["except"]) for t in https["to"]}
    for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
                 "100.64.0.0/10", "127.0.0.0/8"):  # fmt: skip
        assert cidr in blocks["0.0.0.0/0"], cidr
    assert {"fc00::/7", "fe80::/10", "::ffff:0:0/96"} <= blocks["::/0"]


def test_passthrough_vllm_allows_exactly_the_gateway_domains() -> None:
    args = container("k8s-passthrough", "vllm")["args"]
    domains = flag_values(args, "--allowed-media-domains")
    gateway = json.loads(gateway_env("k8s-passthrough")["GATEWAY_MEDIA__ALLOWED_DOMAINS"])
    assert domains and sorted(domains) == sorted(gateway)
    # vLLM compares exact host names: a wildcard or port would never match there.
    assert all(re.fullmatch(r"[a-z0-9.-]+", d) for d in domains)
    assert k8s_env(container("k8s-passthrough", "vllm"))["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    # The inline base lists the same hosts for the gateway; the engine there allows none.
    base = json.loads(gateway_env("k8s-base")["GATEWAY_MEDIA__ALLOWED_DOMAINS"])
    assert base == gateway
    # Everything else in the pod is the base's.
    for name in ("vllm", "gateway"):
        b, p = container("k8s-base", name), container("k8s-passthrough", name)
        assert {k: v for k, v in b.items() if k not in ("args", "env")} == {
            k: v for k, v in p.items() if k not in ("args", "env")
        }


# --- the Dockerfile -------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def exec_form(rest: str) -> list[str]:
    value: list[str] = json.loads(rest)
    return value


def healthcheck_command() -> list[str]:
    (rest,) = [r for i, r in dockerfile() if i == "HEALTHCHECK"]
    return exec_form(rest[rest.index("CMD") + 3 :].strip())


def test_dockerfile_runs_as_a_non_root_user_from_slim_python() -> None:
    steps = dockerfile()
    froms = [r for i, r in steps if i == "FROM"]
    assert froms and all(f.split()[0] == "python:3.11-slim" for f in froms)
    # The last USER decides what the container runs as: numeric, not root.
    users = [r for i, r in steps if i == "USER"]
    assert users, "no USER line: the container would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    last_from = max(n for n, (i, _) in enumerate(steps) if i == "FROM")
    after_user = [i for i, _ in steps[steps.index(("USER", users[-1])) :]]
    assert "RUN" not in after_user and steps.index(("USER", users[-1])) > last_from
    # The deployments agree with the image's user.
    assert str(compose_service("gateway")["user"]) == users[-1]
    sc = container("k8s-base", "gateway")["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"]) == (int(uid), int(gid))


def test_dockerfile_installs_the_package_without_dev_tools_and_carries_no_secrets() -> None:
    steps = dockerfile()
    runs = " ".join(r for i, r in steps if i == "RUN")
    assert re.search(r"pip install [^&]* \.(\s|$)", runs), "pip install . of this repo"
    assert "[test]" not in runs and "[bench]" not in runs
    names = [r.split("=")[0].split()[0] for i, r in steps if i in ("ARG",)]
    env_names = re.findall(r"(\w+)=", " ".join(r for i, r in steps if i == "ENV"))
    secretish = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.I)
    assert not [n for n in names + env_names if secretish.search(n)]
    copies = " ".join(r for i, r in steps if i in ("COPY", "ADD"))
    assert "keys" not in copies and ".env" not in copies and "deploy" not in copies
    assert "ADD" not in [i for i, _ in steps]  # no remote fetches or archive unpacking


def test_dockerfile_serves_8080_with_a_healthcheck_on_healthz() -> None:
    steps = dockerfile()
    assert ("EXPOSE", "8080") in steps
    (entry,) = [exec_form(r) for i, r in steps if i == "ENTRYPOINT"]
    assert entry == ["vllm-gateway", "serve", "--host", "0.0.0.0", "--port", "8080"]
    assert "127.0.0.1:8080/healthz" in " ".join(healthcheck_command())
    env = " ".join(r for i, r in steps if i == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env  # nothing written on a read-only root


def test_dockerignore_lets_only_the_build_inputs_through() -> None:
    lines = [
        x.strip()
        for x in (ROOT / ".dockerignore").read_text().splitlines()
        if x.strip() and not x.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    copied = set()
    for i, r in dockerfile():
        if i == "COPY" and "--from" not in r:
            copied.update(p.rstrip("/") for p in r.split()[:-1])
    assert copied == allowed == {"pyproject.toml", "README.md", "gateway", "bench"}


# --- the stack, run as processes ----------------------------------------------------------


def png_data_url() -> str:
    return data_url("image/png", png())


def chat(url: str, key: str | None, image_url: str | None = None) -> httpx.Response:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    if image_url is not None:
        content.append({"type": "image_url", "image_url": {"url": image_url}})
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": "Qwen/Qwen3-VL-2B-Instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
    }
    return HTTP.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def sim_from_compose(tmp: Path) -> Proc:
    """The compose `engine-sim` command, moved to a free loopback port."""
    args = compose_command("engine-sim")
    port = free_port()
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        (i,) = [n for n, a in enumerate(args) if a.startswith(flag + "=")]
        args[i] = f"{flag}={value}"
    entry = compose_service("engine-sim")["entrypoint"]
    assert entry[:1] == ["python"]
    proc = sim_proc(tmp, port=port)
    proc.args = [sys.executable, *entry[1:], *args]
    return proc


def gateway_from(variant: str, tmp: Path, engine_url: str) -> Proc:
    env = gateway_env(variant)
    env["GATEWAY_ENGINES"] = json.dumps([engine_url])
    env["GATEWAY_API_KEYS_FILE"] = str(key_file(tmp))
    return gateway_proc(tmp, env)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    tmp = tmp_path_factory.mktemp("deploy")
    engine = sim_from_compose(tmp)
    with running(engine):
        procs = {v: gateway_from(v, tmp, engine.url) for v in VARIANTS}
        with running(*procs.values(), ready_path="/healthz"):
            for p in procs.values():
                ready = wait_for(lambda p=p: HTTP.get(p.url + "/readyz").status_code == 200)
                assert ready, p.log()
            yield {"engine": engine, **procs}


@pytest.mark.slow
def test_engine_refuses_callers_without_the_upstream_key(stack: dict[str, Proc]) -> None:
    engine = stack["engine"].url
    assert HTTP.get(engine + "/v1/models", timeout=5).status_code == 401
    bad = {"Authorization": f"Bearer {CLIENT_KEY}"}
    assert HTTP.get(engine + "/v1/models", headers=bad, timeout=5).status_code == 401
    ok = {"Authorization": f"Bearer {UPSTREAM}"}
    assert HTTP.get(engine + "/v1/models", headers=ok, timeout=5).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_deployed_gateway_serves_keyed_clients_only(
    variant: str, stack: dict[str, Proc]
) -> None:
    gw, engine = stack[variant].url, stack["engine"].url
    before = sim_received(engine)
    r = chat(gw, None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = chat(gw, UPSTREAM)  # the engine's key is not a client key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert sim_received(engine) == before
    r = chat(gw, CLIENT_KEY, png_data_url())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert sim_received(engine) == before + 1
    # LoRA loading is blocked before the engine.
    r = HTTP.post(
        gw + "/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/etc"},
        headers={"Authorization": f"Bearer {CLIENT_KEY}"},
        timeout=5,
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "endpoint_blocked"
    assert sim_received(engine) == before + 1
    assert UPSTREAM not in stack[variant].log() and CLIENT_KEY not in stack[variant].log()


@pytest.mark.slow
def test_engine_media_tripwire_refuses_remote_urls(stack: dict[str, Proc]) -> None:
    """`--allowed-media-domains media.invalid`: even a URL that reached the engine
    directly is refused before any connection, while the gateway's data: URLs pass."""
    engine, gw = stack["engine"].url, stack["compose"].url
    with RecordingServer() as canary:
        url = canary.url + "/cat.png"
        r = chat(engine, UPSTREAM, url)
        assert r.status_code in (400, 422), r.text
        assert "allowed domains" in r.text
        before = sim_received(engine)
        r = chat(gw, CLIENT_KEY, url)
        assert r.status_code == 400 and r.json()["error"]["code"] == "media_url_not_allowed"
        assert sim_received(engine) == before
        assert not canary.contacted
    assert chat(engine, UPSTREAM, png_data_url()).status_code == 200


@pytest.mark.slow
def test_dockerfile_healthcheck_command_runs(stack: dict[str, Proc]) -> None:
    port = stack["compose"].port
    cmd = [sys.executable if a == "python" else a for a in healthcheck_command()]
    live = [a.replace("127.0.0.1:8080", f"127.0.0.1:{port}") for a in cmd]
    assert subprocess.run(live, capture_output=True, timeout=10).returncode == 0
    dead = [a.replace("127.0.0.1:8080", f"127.0.0.1:{free_port()}") for a in cmd]
    assert subprocess.run(dead, capture_output=True, timeout=10).returncode != 0


@pytest.mark.slow
def test_k8s_engine_probe_command_runs(stack: dict[str, Proc]) -> None:
    vllm = container("k8s-base", "vllm")
    probe = vllm["livenessProbe"]["exec"]["command"]
    assert probe == vllm["startupProbe"]["exec"]["command"] and probe[0] == "python3"
    assert "127.0.0.1:8000/health" in probe[-1]
    port = stack["engine"].port
    live = [sys.executable, *(a.replace(":8000/", f":{port}/") for a in probe[1:])]
    assert subprocess.run(live, capture_output=True, timeout=10).returncode == 0
    dead = [sys.executable, *(a.replace(":8000/", f":{free_port()}/") for a in probe[1:])]
    assert subprocess.run(dead, capture_output=True, timeout=10).returncode != 0
