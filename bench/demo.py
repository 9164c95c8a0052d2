"""The README's first command: the gateway in front of two simulated engines, on loopback.

`python -m bench.demo` starts two simulated vLLM engines and the gateway with a freshly
generated API key, sends a few requests through it (chat, streaming chat, a blocked
route, a request without a key, a path trick, a LoRA path in `model`, image URLs
aimed at internal addresses, a dangerous field), prints what happened, and stops
everything.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from PIL import Image

from bench.harness.server import free_port, terminate

ROOT = Path(__file__).resolve().parent.parent


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited early:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not become ready:\n{log.read_text(errors='replace')}")


@contextmanager
def _started(
    args: list[str], ready: str, log: Path, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(ready, proc, log)
        yield proc
    finally:
        terminate(proc)


def _show(title: str, resp: httpx.Response) -> None:
    try:
        body = resp.json()
        detail = body["error"]["code"] if "error" in body else json.dumps(body)[:160]
    except (ValueError, KeyError, TypeError):
        detail = resp.text[:160]
    print(f"  {title:<52} -> {resp.status_code} {detail}")


def _whole_words(text: str) -> str:
    """The simulated engine's reply without its first and last words, which it cuts: it
    answers with a canned sentence from a point the prompt picks, for as many tokens (4
    characters each) as asked."""
    return " ".join(w for w in text.split(" ")[1:-1] if w)


class _WordPrinter:
    """Prints streamed text a whole word at a time, leaving out the cut first and last
    words (see `_whole_words`)."""

    def __init__(self) -> None:
        self._pending = ""
        self._first = True

    def feed(self, text: str) -> None:
        self._pending += text
        *words, self._pending = self._pending.split(" ")
        for word in words:
            if not self._first and word:
                print(word, end=" ", flush=True)
            self._first = False


def _png() -> str:
    image = Image.new("RGB", (64, 48), "white")
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(model: str, url: str) -> dict[str, object]:
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": content}]}


def main() -> int:
    key = "sk-demo-" + secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory(prefix="vllm-gateway-demo-") as logs:
        return _run(key, env, Path(logs))


def _run(key: str, env: dict[str, str], tmp: Path) -> int:
    ports = [free_port() for _ in range(3)]
    engines = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    gateway = f"http://127.0.0.1:{ports[2]}"
    print(f"Starting 2 simulated engines ({', '.join(engines)}) and the gateway ({gateway}).")
    print(f"Logs in {tmp} (removed at the end). The demo key is generated for this run only.")
    print("The simulated engines answer with canned text: no model runs.\n")
    sims = [
        [sys.executable, "-m", "bench.sim", "--host", "127.0.0.1", "--port", str(p)]
        for p in ports[:2]
    ]
    gw_env = {
        **env,
        "GATEWAY_ENGINES": json.dumps(engines),
        "GATEWAY_API_KEYS": json.dumps([key]),
        "GATEWAY_LOG_FORMAT": "json",
    }
    serve = [
        sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1",
        "--port", str(ports[2]),
    ]  # fmt: skip
    with (
        _started(sims[0], engines[0] + "/health", tmp / "engine-1.log", env),
        _started(sims[1], engines[1] + "/health", tmp / "engine-2.log", env),
        _started(serve, gateway + "/readyz", tmp / "gateway.log", gw_env),
        httpx.Client(base_url=gateway, timeout=30) as client,
    ):
        auth = {"Authorization": f"Bearer {key}"}
        models = client.get("/v1/models", headers=auth).json()
        model = models["data"][0]["id"]
        print(f"The engines serve {model!r}; the gateway learned it from /v1/models.\n")
        chat = {"model": model, "messages": [{"role": "user", "content": "Hello!"}]}

        print("Allowed:")
        r = client.post("/v1/chat/completions", headers=auth, json={**chat, "max_tokens": 16})
        answer = _whole_words(r.json()["choices"][0]["message"]["content"])
        print(f"  {'POST /v1/chat/completions':<52} -> {r.status_code} {answer!r}")
        print(f"  {'streaming, words as they arrive:':<52} -> ", end="", flush=True)
        body = {**chat, "max_tokens": 24, "stream": True}
        words = _WordPrinter()
        with client.stream("POST", "/v1/chat/completions", headers=auth, json=body) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    words.feed(delta)
        print()
        r = client.post("/v1/chat/completions", headers=auth, json=_image_chat(model, _png()))
        tokens = r.json()["usage"]["prompt_tokens"]
        title = "a chat with a data: image (validated by the gateway)"
        print(f"  {title:<52} -> {r.status_code} prompt_tokens={tokens}")

        # Four conversations of three turns each; which engine served each turn is read
        # from the gateway's log below.
        for conv in range(4):
            messages: list[dict[str, str]] = []
            for turn in range(3):
                messages.append({"role": "user", "content": f"Conversation {conv}, turn {turn}."})
                r = client.post(
                    "/v1/chat/completions",
                    headers={**auth, "X-Request-Id": f"demo-conv{conv}-turn{turn}"},
                    json={"model": model, "max_tokens": 8, "messages": messages},
                )
                reply = r.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})

        print("\nRefused by the gateway (none of these reaches an engine):")
        _show(
            "POST /v1/chat/completions without a key",
            client.post("/v1/chat/completions", json=chat),
        )
        _show(
            "... with a wrong key",
            client.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer x"}),
        )
        _show(
            "POST /v1/load_lora_adapter (runtime LoRA loading)",
            client.post("/v1/load_lora_adapter", headers=auth, json={"lora_name": "x"}),
        )
        _show("POST /collective_rpc (vLLM dev mode)", client.post("/collective_rpc", headers=auth))
        _show("GET /docs (engine API docs)", client.get("/docs", headers=auth))
        _show(
            'POST /v1/chat/completions with model "../x"',
            client.post("/v1/chat/completions", headers=auth, json={**chat, "model": "../x"}),
        )
        _show("GET /V1/models (a case variant)", client.get("/V1/models", headers=auth))
        _show("GET /metrics with an inference key", client.get("/metrics", headers=auth))
        _show("GET /no/such/route", client.get("/no/such/route", headers=auth))
        metadata = "http://169.254.169.254/latest/meta-data/"
        _show(
            "an image URL at the cloud metadata address",
            client.post("/v1/chat/completions", headers=auth, json=_image_chat(model, metadata)),
        )
        _show(
            "an image URL at the engine's own /metrics",
            client.post(
                "/v1/chat/completions",
                headers=auth,
                json=_image_chat(model, engines[0] + "/metrics"),
            ),
        )
        _show(
            "a 'file:///etc/passwd' image",
            client.post(
                "/v1/chat/completions", headers=auth, json=_image_chat(model, "file:///etc/passwd")
            ),
        )
        _show(
            "prompt_embeds (torch.load of client bytes in vLLM)",
            client.post(
                "/v1/completions",
                headers=auth,
                json={"model": model, "prompt": "x", "prompt_embeds": "AAAA"},
            ),
        )

    entries = []
    for line in (tmp / "gateway.log").read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "request":
            entries.append(entry)
    engines_of: dict[str, list[str]] = {}
    for entry in entries:
        rid = str(entry.get("request_id", ""))
        if rid.startswith("demo-conv"):
            conversation = rid.split("-")[1]
            engines_of.setdefault(conversation, []).append(str(entry.get("engine")))
    print("\nRouting: four conversations of three turns each, from the gateway's log")
    print("(every turn of a conversation goes to the engine that has its prefix cached):")
    for conversation, used in sorted(engines_of.items()):
        print(f"  {conversation}: turns served by {', '.join(used)}")
    print("\nThe gateway's request log (one line per request, no keys, no prompts):")
    for line in (tmp / "gateway.log").read_text(errors="replace").splitlines()[-16:]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "request":
            fields = ("status", "code", "method", "path", "key_name", "model", "engine")
            print("  " + " ".join(f"{f}={entry.get(f)}" for f in fields if entry.get(f)))
    print("\nEverything stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
