"""Every configuration mistake: `vllm-gateway check-config` (and `serve`). Each ends with
exit code 2 and one line on stderr that names the problem and its source (the file and
line, or the variable), without a traceback and without the rejected value. The table
of mistakes runs the command's `main` in this process (a subprocess costs a second per
case); `serve` and the cases around the table run it in a subprocess, as an operator
does."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.harness.metrics import HTTP
from gateway import cli
from gateway.app import load_keys
from gateway.config.key_file import hash_key
from gateway.config.settings import load_settings
from tests.procs import (
    ROOT,
    auth,
    clean_env,
    free_port,
    gateway_proc,
    run_cli,
    running,
    sim_proc,
    wait_for,
)

SECRET = "sk-cfg-secret-0123456789abcdef"
KEYS = json.dumps([SECRET])
# An engine, for the cases that must get past the check that one is configured.
ENGINES = json.dumps(["http://127.0.0.1:8001"])
OTHER = "sk-cfg-other-0123456789abcdef"
# A settings file with one unnamed key (`key-1`) and the key file beside it (and an
# engine: keys are checked as the app is built, after the check that one is configured).
BOTH_SOURCES = (
    f"api_keys: [{SECRET}]\napi_keys_file: {{dir}}/keys.yaml\nengines: [http://127.0.0.1:8001]\n"
)


@dataclass
class Mistake:
    """A configuration: the file (`gateway.yaml`, when given), a key file
    (`keys.yaml`), the environment; and what the one error line must say."""

    file: str | None = None
    keys: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    source: str = ""  # `gateway.yaml:N`, `keys.yaml...`, or a variable's name
    says: tuple[str, ...] = ()


MISTAKES: dict[str, Mistake] = {
    "a store URL without a scheme": Mistake(
        file=f"api_keys: [{SECRET}]\nrouting:\n  store_url: {SECRET}@localhost:6379\n",
        source="{dir}/gateway.yaml:3",
        says=("routing.store_url: must start with redis://, rediss:// or unix://",),
    ),
    "a store URL with a password and no host": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ROUTING__STORE_URL": f"redis://:{SECRET}@"},
        source="GATEWAY_ROUTING__STORE_URL",
        says=("a redis:// URL needs a host",),
    ),
    "unknown nested key": Mistake(
        file=f"api_keys: [{SECRET}]\nmedia:\n  mode: inline\n  allowed_domain: [example.com]\n",
        source="{dir}/gateway.yaml:4",
        says=("media.allowed_domain: unknown setting; did you mean allowed_domains?",),
    ),
    "unknown top-level key": Mistake(
        file=f"api_keys: [{SECRET}]\nengine: [http://127.0.0.1:8001]\n",
        source="{dir}/gateway.yaml:2",
        says=("engine: unknown setting; did you mean engines?",),
    ),
    "a key in kebab case": Mistake(
        file=f"api_keys: [{SECRET}]\nmedia:\n  allowed-domains: [example.com]\n",
        source="{dir}/gateway.yaml:3",
        says=("media.allowed-domains: unknown setting; did you mean allowed_domains?",),
    ),
    "unknown key of a key entry": Mistake(
        file=f"api_keys:\n  - key: {SECRET}\n    scope: [inference]\n",
        source="{dir}/gateway.yaml:3",
        says=("api_keys.0.scope: unknown setting; did you mean scopes?",),
    ),
    "misspelt variable": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ENGINE": '["http://127.0.0.1:8001"]'},
        source="GATEWAY_ENGINE",
        says=("unknown setting; did you mean GATEWAY_ENGINES?",),
    ),
    "misspelt nested variable": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_MEDIA__ALLOWED_DOMAIN": '["example.com"]'},
        source="GATEWAY_MEDIA__ALLOWED_DOMAIN",
        says=("did you mean GATEWAY_MEDIA__ALLOWED_DOMAINS?",),
    ),
    "unknown key in a JSON object variable": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ROUTING": '{"polcy": "round_robin"}'},
        source="GATEWAY_ROUTING",
        says=("routing.polcy: unknown setting; did you mean policy?",),
    ),
    "a URL in allowed_domains": Mistake(
        file=f'api_keys: [{SECRET}]\nmedia:\n  allowed_domains: ["https://example.com"]\n',
        source="{dir}/gateway.yaml:3",
        says=("media.allowed_domains.0", "rule: scheme"),
    ),
    "a bad network": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_MEDIA__ALLOWED_NETWORKS": '["10.0.0.1/8"]'},
        source="GATEWAY_MEDIA__ALLOWED_NETWORKS",
        says=("media.allowed_networks", "not a network"),
    ),
    "a trusted proxy that is not a network": Mistake(
        file=f"api_keys: [{SECRET}]\ntrusted_proxies: [10.0.0.0/8, 10.1.2.3/16]\n",
        source="{dir}/gateway.yaml:2",
        says=("trusted_proxies", "entry 1 is not a network"),
    ),
    "an address as a trusted proxy's network": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_TRUSTED_PROXIES": '["ingress.local"]'},
        source="GATEWAY_TRUSTED_PROXIES",
        says=("trusted_proxies", "entry 0 is not a network"),
    ),
    "a negative count of failed authentications": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_LIMITS__AUTH_FAILURES": "-1"},
        source="GATEWAY_LIMITS__AUTH_FAILURES",
        says=("limits.auth_failures",),
    ),
    "an unknown audio format": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_MEDIA__AUDIO_FORMATS": '["wav", "aiff"]'},
        source="GATEWAY_MEDIA__AUDIO_FORMATS",
        says=("media.audio_formats", "unknown formats aiff"),
    ),
    "a scheme media cannot be fetched with": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_MEDIA__ALLOWED_SCHEMES": '["ftp"]'},
        source="GATEWAY_MEDIA__ALLOWED_SCHEMES",
        says=("media.allowed_schemes", "only http and https"),
    ),
    "an engine without a scheme": Mistake(
        file=f"api_keys: [{SECRET}]\nengines:\n  - http://127.0.0.1:8001\n  - 127.0.0.1:8002\n",
        source="{dir}/gateway.yaml:4",
        says=("engines.1: an engine needs a scheme", "dns+http://"),
    ),
    "an engine of another scheme": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ENGINES": '["ftp://127.0.0.1:8001"]'},
        source="GATEWAY_ENGINES",
        says=("engines.0: an engine needs a scheme",),
    ),
    # Credentials in an engine URL were never sent (the engine's key is
    # upstream_api_key), and the URL labels log lines and metrics.
    "an engine URL with a password": Mistake(
        file=f"api_keys: [{SECRET}]\nengines:\n  - http://gw:{SECRET}@127.0.0.1:8001\n",
        source="{dir}/gateway.yaml:3",
        says=("engines.0: an engine URL may not carry a user name or password",),
    ),
    "a DNS engine entry with a password": Mistake(
        env={
            "GATEWAY_API_KEYS": KEYS,
            "GATEWAY_ENGINES": f'["dns+http://{SECRET}@localhost:8001"]',
        },
        source="GATEWAY_ENGINES",
        says=("engines.0: an engine URL may not carry a user name or password",),
    ),
    "an engine URL with a query": Mistake(
        env={
            "GATEWAY_API_KEYS": KEYS,
            "GATEWAY_ENGINES": f'["http://127.0.0.1:8001/?key={SECRET}"]',
        },
        source="GATEWAY_ENGINES",
        says=("engines.0: an engine URL may not carry a query or a fragment",),
    ),
    "engines with a password, not a JSON list": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ENGINES": f"http://gw:{SECRET}@127.0.0.1:8001"},
        source="GATEWAY_ENGINES",
        says=("not valid JSON; engines is a list, given as JSON: ",),
    ),
    "engines not a JSON list": Mistake(
        env={
            "GATEWAY_API_KEYS": KEYS,
            "GATEWAY_ENGINES": "http://127.0.0.1:8001, http://[::1]:8002",
        },
        source="GATEWAY_ENGINES",
        says=(
            "not valid JSON; engines is a list, given as JSON: "
            """GATEWAY_ENGINES='["http://127.0.0.1:8001", "http://[::1]:8002"]'""",
        ),
    ),
    # The value of a setting that holds secrets is never shown, even reshaped.
    "keys not a JSON list": Mistake(
        env={"GATEWAY_API_KEYS": f"{SECRET},{SECRET}x"},
        source="GATEWAY_API_KEYS",
        says=("""api_keys is a list, given as JSON: GATEWAY_API_KEYS='["first", "second"]'""",),
    ),
    "YAML syntax error": Mistake(
        file=f"api_keys: [{SECRET}]\nengines: [http://127.0.0.1:8001\nport: 80\n",
        source="{dir}/gateway.yaml:3",
        says=("not valid YAML",),
    ),
    "a key given twice": Mistake(
        file=f"api_keys: [{SECRET}]\nmedia:\n  mode: inline\nmedia:\n  max_items: 4\n",
        source="{dir}/gateway.yaml:4",
        says=("media: given twice (first on line 2)",),
    ),
    "not a mapping": Mistake(
        file="- engines\n", source="{dir}/gateway.yaml:1", says=("expected a mapping of settings",)
    ),
    "an unquoted off": Mistake(
        file=f"api_keys: [{SECRET}]\npayload:\n  cache_isolation: off\n",
        source="{dir}/gateway.yaml:3",
        says=("payload.cache_isolation", "'off', 'key' or 'tenant'", "quote it"),
    ),
    "an unknown scope": Mistake(
        file=f"api_keys:\n  - key: {SECRET}\n    scopes: [inference, audios]\n",
        source="{dir}/gateway.yaml:1",
        says=("unknown scopes audios; known: admin, audio, inference, info, metrics, models",),
    ),
    "an unknown routing policy": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ROUTING__POLICY": "fastest"},
        source="GATEWAY_ROUTING__POLICY",
        says=("routing.policy: Input should be 'affinity', 'round_robin' or 'least_loaded'",),
    ),
    "a short plain key": Mistake(
        env={"GATEWAY_API_KEYS": '["my-client-key"]'},
        source="GATEWAY_API_KEYS",
        says=("a plain API key must be at least 16 characters", "secrets.token_urlsafe"),
    ),
    "a key that is neither a string nor an object": Mistake(
        env={"GATEWAY_API_KEYS": "[5]"},
        source="GATEWAY_API_KEYS",
        says=("api_keys.0: matches no accepted form",),
    ),
    "a value out of range": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_TIMEOUTS__UPSTREAM_KEEPALIVE": "6"},
        source="GATEWAY_TIMEOUTS__UPSTREAM_KEEPALIVE",
        says=("timeouts.upstream_keepalive", "less than 5"),
    ),
    "no keys at all": Mistake(env={}, says=("no API keys configured",)),
    "a missing key file": Mistake(
        file="api_keys_file: {dir}/nowhere.yaml\n",
        source="{dir}/gateway.yaml:1",
        says=("api_keys_file: key file {dir}/nowhere.yaml not found",),
    ),
    "a key file that is not YAML": Mistake(
        file="api_keys_file: {dir}/keys.yaml\n",
        keys=f"- key: {SECRET}\n- key: : :\n",
        source="{dir}/gateway.yaml:1",
        says=("key file {dir}/keys.yaml:2 is not valid YAML",),
    ),
    "a key file entry with a misspelt field": Mistake(
        env={"GATEWAY_API_KEYS_FILE": "{dir}/keys.yaml"},
        keys=f"- key: {SECRET}\n  scopez: [inference]\n",
        source="GATEWAY_API_KEYS_FILE",
        says=("key file {dir}/keys.yaml: entry 1: scopez: unknown field; did you mean scopes?",),
    ),
    # YAML keeps the last of two equal keys: `models: null` after a list freed the key.
    "a key file entry with a field given twice": Mistake(
        env={"GATEWAY_API_KEYS_FILE": "{dir}/keys.yaml"},
        keys=f"- key: {SECRET}\n  models: [chat]\n  models: null\n",
        source="GATEWAY_API_KEYS_FILE",
        says=("key file {dir}/keys.yaml:3: a field is given twice (first on line 2)",),
    ),
    # The same key in both sources: the first would win authentication, and the other
    # entry's narrower scopes, models and limits would be silently ignored.
    "the same key in api_keys and the key file": Mistake(
        file=BOTH_SOURCES,
        keys=f"- key: {OTHER}\n- key: {SECRET}\n  scopes: [models]\n",
        says=("api_keys entry 1 and key file {dir}/keys.yaml entry 2: the same key",),
    ),
    "the same key, as its digest in the key file": Mistake(
        env={
            "GATEWAY_API_KEYS": KEYS,
            "GATEWAY_API_KEYS_FILE": "{dir}/keys.yaml",
            "GATEWAY_ENGINES": ENGINES,
        },
        keys=f"- {hash_key(SECRET)}\n",
        says=("api_keys entry 1 and key file {dir}/keys.yaml entry 1: the same key",),
    ),
    # Usage and limits by name would meter two keys as one.
    "a key name in api_keys and the key file": Mistake(
        file=f"api_keys:\n  - {OTHER}x\n  - key: {SECRET}\n    name: team-a\n"
        "api_keys_file: {dir}/keys.yaml\nengines: [http://127.0.0.1:8001]\n",
        keys=f"- key: {OTHER}\n  name: team-a\n",
        says=(
            'api_keys entry 2 and key file {dir}/keys.yaml entry 1: the name "team-a" is '
            "used twice",
        ),
    ),
    "a key file name that is an unnamed key's": Mistake(
        file=BOTH_SOURCES,
        keys=f"- key: {OTHER}\n  name: key-1\n",
        says=(
            'api_keys entry 1 and key file {dir}/keys.yaml entry 1: the name "key-1" is used twice',
        ),
    ),
    # deploy/'s example Secrets mark what the operator must fill in with REPLACE-.
    "the placeholder namespace secret": Mistake(
        env={
            "GATEWAY_API_KEYS": KEYS,
            "GATEWAY_PAYLOAD__NAMESPACE_SECRET": "REPLACE-with-" + SECRET,
        },
        source="GATEWAY_PAYLOAD__NAMESPACE_SECRET",
        says=("payload.namespace_secret", "still the placeholder (REPLACE-...)"),
    ),
    "a short namespace secret": Mistake(
        file=f"api_keys: [{SECRET}]\npayload:\n  namespace_secret: {SECRET[:12]}\n",
        source="{dir}/gateway.yaml:3",
        says=("payload.namespace_secret", "at least 16 characters"),
    ),
    "a CA file that is not PEM": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_MEDIA__CA_FILE": "{dir}/keys.yaml"},
        keys="not a certificate\n",
        source="GATEWAY_MEDIA__CA_FILE",
        says=("media.ca_file: the file holds no PEM certificate TLS can load",),
    ),
    "an engine CA file that is not PEM": Mistake(
        file="api_keys: [" + SECRET + "]\nengine_ca_file: {dir}/keys.yaml\n",
        keys="not a certificate\n",
        source="{dir}/gateway.yaml:2",
        says=("engine_ca_file: the file holds no PEM certificate TLS can load",),
    ),
    "an engine URL ending in /v1": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ENGINES": '["http://127.0.0.1:8000/v1"]'},
        source="GATEWAY_ENGINES",
        says=("engines.0", "did you mean the base URL without /v1"),
    ),
    "a DNS engine entry with /v1/ in its path": Mistake(
        file=f"api_keys: [{SECRET}]\nengines:\n  - http://127.0.0.1:8000/vllm\n"
        "  - dns+http://engine.svc:8000/v1/\n",
        source="{dir}/gateway.yaml:4",
        says=("engines.1", "did you mean the base URL without /v1"),
    ),
    "no engines": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ENGINES": "[]"},
        says=("no engines configured: set GATEWAY_ENGINES or `engines`",),
    ),
    "a certificate without its key": Mistake(
        env={
            "GATEWAY_API_KEYS": KEYS,
            "GATEWAY_ENGINES": ENGINES,
            "GATEWAY_SSL_CERTFILE": "{dir}/keys.yaml",
        },
        keys="not a certificate\n",
        says=("ssl_certfile and ssl_keyfile go together: set both",),
    ),
    "a certificate and key TLS cannot load": Mistake(
        file=f"api_keys: [{SECRET}]\nssl_certfile: {{dir}}/keys.yaml\n"
        "ssl_keyfile: {dir}/keys.yaml\n",
        keys="not a certificate\n",
        says=("ssl_certfile and ssl_keyfile: TLS cannot load them",),
    ),
    "a key file for TLS that does not exist": Mistake(
        env={
            "GATEWAY_API_KEYS": KEYS,
            "GATEWAY_SSL_CERTFILE": "{dir}/keys.yaml",
            "GATEWAY_SSL_KEYFILE": "{dir}/nowhere.pem",
        },
        keys="not a certificate\n",
        source="GATEWAY_SSL_KEYFILE",
        says=("ssl_keyfile",),
    ),
    "a CA file that does not exist": Mistake(
        env={"GATEWAY_API_KEYS": KEYS, "GATEWAY_ENGINE_CA_FILE": "{dir}/nowhere.pem"},
        source="GATEWAY_ENGINE_CA_FILE",
        says=("engine_ca_file",),
    ),
}


Run = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """`run_cli` in this process: the environment `env` in place of this one's GATEWAY_*
    variables, stdout and stderr captured."""

    def run(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(ROOT)
        capsys.readouterr()
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out, err)

    return run


def check(tmp_path: Path, mistake: Mistake, *argv: str, run: Run = run_cli) -> str:
    """Run the command on `mistake`; return its one error line. `{dir}` in the
    mistake's texts stands for the directory of its files."""

    def here(text: str) -> str:
        return text.replace("{dir}", str(tmp_path))

    if mistake.file is not None:
        (tmp_path / "gateway.yaml").write_text(here(mistake.file))
        argv = (*argv, "--config", str(tmp_path / "gateway.yaml"))
    if mistake.keys is not None:
        (tmp_path / "keys.yaml").write_text(mistake.keys)
    env = clean_env({name: here(value) for name, value in mistake.env.items()})
    result = run(*argv, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert SECRET not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith(f"vllm-gateway: {here(mistake.source)}")
    for text in mistake.says:
        assert here(text) in line
    return line


@pytest.mark.parametrize("name", list(MISTAKES))
def test_check_config_names_the_mistake_and_its_source(
    tmp_path: Path, name: str, in_process: Run
) -> None:
    check(tmp_path, MISTAKES[name], "check-config", run=in_process)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unknown nested key", "misspelt variable", "a bad network"])
def test_check_config_in_a_subprocess_says_the_same(tmp_path: Path, name: str) -> None:
    """The table's answers are the command's, not only its `main`'s."""
    check(tmp_path, MISTAKES[name], "check-config")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "a URL in allowed_domains",
        "misspelt variable",
        "YAML syntax error",
        "an engine URL ending in /v1",
        "no engines",
        "a certificate without its key",
    ],
)
def test_serve_refuses_the_same_mistakes_the_same_way(tmp_path: Path, name: str) -> None:
    """`serve` loads settings with the same code: it exits before listening."""
    check(tmp_path, MISTAKES[name], "serve", "--port", str(free_port()))


@pytest.mark.slow
def test_every_mistake_is_reported_at_once(tmp_path: Path) -> None:
    (tmp_path / "gateway.yaml").write_text(
        f"api_keys: [{SECRET}]\nengines: [localhost:8001]\nrouting: {{policy: fast}}\n"
    )
    config = str(tmp_path / "gateway.yaml")
    result = run_cli("check-config", "--config", config, env=clean_env())
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"vllm-gateway: {config}:2: engines.0: an engine needs a scheme: http://, https://, "
        "dns+http:// or dns+https:// (e.g. http://127.0.0.1:8000)",
        f"vllm-gateway: {config}:3: routing.policy: Input should be 'affinity', "
        "'round_robin' or 'least_loaded'",
    ]


@pytest.mark.slow
def test_a_documented_variable_that_is_not_a_setting_is_let_through(tmp_path: Path) -> None:
    """compose.yaml reads GATEWAY_BIND on the host: an operator's shell may export it."""
    env = clean_env(
        {"GATEWAY_API_KEYS": KEYS, "GATEWAY_ENGINES": ENGINES, "GATEWAY_BIND": "0.0.0.0"}
    )
    result = run_cli("check-config", env=env)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_the_environment_wins_over_the_file_and_is_named_as_the_source(tmp_path: Path) -> None:
    (tmp_path / "gateway.yaml").write_text(f"api_keys: [{SECRET}]\nrouting: {{policy: affinity}}\n")
    config = str(tmp_path / "gateway.yaml")
    env = clean_env({"GATEWAY_ROUTING__POLICY": "fastest"})
    result = run_cli("check-config", "--config", config, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("vllm-gateway: GATEWAY_ROUTING__POLICY: routing.policy:")
    env = clean_env({"GATEWAY_ROUTING__POLICY": "round_robin", "GATEWAY_ENGINES": ENGINES})
    result = run_cli("check-config", "--config", config, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["routing"]["policy"] == "round_robin"


@pytest.mark.slow
def test_a_command_line_option_is_named_as_the_source() -> None:
    env = clean_env({"GATEWAY_API_KEYS": KEYS})
    result = run_cli("serve", "--port", "70000", env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("vllm-gateway: --port: port: Input should be less than")


def test_unnamed_keys_are_numbered_through_both_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unnamed key in the file is numbered on from the settings' own (`key-2`, not a
    second `key-1`), so keys without names in both sources are accepted."""
    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    (tmp_path / "keys.yaml").write_text(f"- {OTHER}\n- key: {OTHER}x\n  name: team-b\n")
    (tmp_path / "gateway.yaml").write_text(BOTH_SOURCES.replace("{dir}", str(tmp_path)))
    keys, from_file = load_keys(load_settings(tmp_path / "gateway.yaml"))
    assert [k.name for k in keys] == ["key-1", "key-2", "team-b"]
    assert from_file == 2


@pytest.mark.slow
def test_a_key_file_reload_that_clashes_with_api_keys_is_refused(tmp_path: Path) -> None:
    """The watcher reloads through the same check: a rewritten key file that reuses a
    name or a key of `api_keys` is logged as refused, naming both places and no key, and
    the keys in force stay."""
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"- key: {OTHER}\n  name: team-a\n")
    sim = sim_proc(tmp_path, "--latency", "zero")
    env = {
        "GATEWAY_ENGINES": json.dumps([f"http://127.0.0.1:{sim.port}"]),
        "GATEWAY_API_KEYS": json.dumps([{"key": SECRET, "name": "ops"}]),
        "GATEWAY_API_KEYS_FILE": str(keys_file),
        # The test polls with a key not yet in force: each poll is a failed
        # authentication from loopback, which the failure throttle would count.
        "GATEWAY_LIMITS__AUTH_FAILURES": "0",
    }
    gateway = gateway_proc(tmp_path, env)
    newcomer = OTHER + "-new"
    with running(sim), running(gateway, ready_path="/healthz"):
        models = gateway.url + "/v1/models"
        assert HTTP.get(models, headers=auth(OTHER)).status_code == 200

        def refusals() -> list[str]:
            lines = [json.loads(x) for x in gateway.log().splitlines() if x.startswith("{")]
            return [x["reason"] for x in lines if x.get("event") == "key_file_invalid"]

        keys_file.write_text(f"- key: {newcomer}\n  name: ops\n")
        assert wait_for(lambda: len(refusals()) == 1, timeout=10)
        assert refusals()[0] == (
            f'api_keys entry 1 and key file {keys_file} entry 1: the name "ops" is used twice'
        )
        keys_file.write_text(f"- key: {newcomer}\n  name: team-b\n- {hash_key(SECRET)}\n")
        assert wait_for(lambda: len(refusals()) == 2, timeout=10)
        assert refusals()[1] == f"api_keys entry 1 and key file {keys_file} entry 2: the same key"
        # The old keys stay in force; the refused file's new key is not let in.
        assert HTTP.get(models, headers=auth(OTHER)).status_code == 200
        assert HTTP.get(models, headers=auth(SECRET)).status_code == 200
        assert HTTP.get(models, headers=auth(newcomer)).status_code == 401
        # A file without the clash is taken.
        keys_file.write_text(f"- key: {newcomer}\n  name: team-b\n")
        assert wait_for(
            lambda: HTTP.get(models, headers=auth(newcomer)).status_code == 200, timeout=10
        )
        assert HTTP.get(models, headers=auth(OTHER)).status_code == 401
        log = gateway.log()
        assert SECRET not in log and OTHER not in log
