"""Health, information and LoRA routes, and the request recorder."""

from __future__ import annotations

import base64
import time
from collections import deque
from typing import Any

import orjson

from bench.sim.config import VERSION
from bench.sim.engine import Engine
from bench.sim.errors import SimError
from bench.sim.http import TEXT, Request, respond, respond_json

METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


async def health(engine: Engine, req: Request) -> None:
    # vLLM answers 200 with an empty body and no content type.
    await respond(req.send, 200, b"", None)


async def not_implemented(engine: Engine, req: Request) -> None:
    # vLLM's answer when a route's handler is not set up for the model: the route raises
    # NotImplementedError, which its exception handler answers 501
    # (vllm/entrypoints/serve/exception_handling/error_response.py).
    raise SimError(
        501, "The model does not support the structured decision API", "NotImplementedError"
    )


async def version(engine: Engine, req: Request) -> None:
    await respond_json(req.send, {"version": VERSION})


async def load(engine: Engine, req: Request) -> None:
    await respond_json(req.send, {"server_load": engine.in_flight})


async def metrics(engine: Engine, req: Request) -> None:
    body = engine.metrics.render(engine.running, engine.waiting, engine.prefix.usage())
    await respond(req.send, 200, body, METRICS_TYPE)


async def models(engine: Engine, req: Request) -> None:
    created = int(time.time())
    cards: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": engine.config.model,
            "parent": None,
            "max_model_len": engine.config.max_model_len,
            "permission": [],
        }
        for name in engine.config.names
    ]
    for name, path in engine.loras.items():
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": engine.config.names[0],
                "max_model_len": None,
                "permission": [],
            }
        )
    await respond_json(req.send, {"object": "list", "data": cards})


def _lora_fields(body: dict[str, Any]) -> tuple[str, str]:
    name = body.get("lora_name", body.get("name"))
    path = body.get("lora_path", body.get("path", body.get("source")))
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise SimError(
            400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
        )
    return name, path


async def load_lora(engine: Engine, req: Request) -> None:
    # A real vLLM reads whatever path or hub repo it is given here: the simulator only
    # records it, so tests can see what a caller managed to make it load.
    name, path = _lora_fields(req.json())
    if name in engine.loras:
        raise SimError(
            400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
        )
    engine.loras[name] = path
    await respond(
        req.send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), TEXT
    )


async def _unload(engine: Engine, req: Request, name: object) -> None:
    if not isinstance(name, str) or name not in engine.loras:
        raise SimError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    del engine.loras[name]
    text = f"Success: LoRA adapter '{name}' removed successfully."
    await respond(req.send, 200, text.encode(), TEXT)


async def unload_lora(engine: Engine, req: Request) -> None:
    await _unload(engine, req, req.json().get("lora_name"))


async def delete_adapter(engine: Engine, req: Request) -> None:
    await _unload(engine, req, req.path.removeprefix("/adapters/"))


class Recorder:
    """The last N requests as they arrived, for tests: GET/DELETE /sim/requests."""

    def __init__(self, size: int) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, req: Request) -> None:
        headers: dict[str, str] = {}
        for key, value in req.headers:
            name = key.decode("latin-1").lower()
            text = value.decode("latin-1")
            headers[name] = f"{headers[name]}, {text}" if name in headers else text
        entry: dict[str, Any] = {
            "method": req.method,
            "path": req.path,
            "query": req.query.decode("latin-1"),
            "headers": headers,
            "body": None,
            "body_base64": None,
        }
        try:
            entry["body"] = req.body.decode("utf-8")
        except UnicodeDecodeError:
            entry["body_base64"] = base64.b64encode(req.body).decode()
        self.entries.append(entry)

    async def serve(self, req: Request) -> None:
        if req.method == "DELETE":
            cleared = len(self.entries)
            self.entries.clear()
            await respond_json(req.send, {"cleared": cleared})
        elif req.method == "GET":
            await respond(req.send, 200, orjson.dumps(list(self.entries)))
        else:
            raise SimError(405, "Method Not Allowed")
