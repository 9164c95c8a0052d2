"""/v1/responses with vLLM's response store (`--enable-responses-api-store`, what
`VLLM_ENABLE_RESPONSES_API_STORE=1` turns on in vLLM).

`POST /v1/responses` generates and, with `store` (true unless the body says false),
keeps the answer under the body's `request_id` (vLLM's own default: `resp_` + a random
id); `GET /v1/responses/{id}` reads it back, `POST /v1/responses/{id}/cancel` answers as
vLLM does for a finished one, and `previous_response_id` must name a stored response.
Like vLLM, the store is one dict per engine process: nothing is shared between engines
or kept across a restart. Shapes of vllm/entrypoints/openai/responses (0.32:
`ResponsesResponse.from_request`, `_make_not_found_error`). A stream is vLLM's
`responses_stream_generator` for a text answer (streaming_events.py,
`emit_simple_content_*`): `response.created` and `response.in_progress` (no usage),
the message item and its part opened, one `response.output_text.delta` a token, the
text, part and item closed, then `response.completed`, the only event with a usage.
Not simulated: `background`, tools.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any

import orjson

from bench.sim import tokenizer
from bench.sim.engine import Engine, EngineRequest
from bench.sim.errors import SimError, bad_request, invalid_body
from bench.sim.generate import lax_bool, output
from bench.sim.http import Request, respond_json, start_stream

PATH = "/v1/responses"
# The most responses kept; the oldest goes first (vLLM keeps every one until restart).
CAPACITY = 10_000


def not_found(response_id: str) -> SimError:
    return SimError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


def _texts(value: Any) -> list[str]:
    """Every string of an `input` (a string, or items with string or part contents)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    if isinstance(value, dict):
        return [t for k in ("content", "text", "output") for t in _texts(value.get(k))]
    return []


def _usage(prompt_tokens: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion,
    }


async def _stream(
    req: Request, seq: EngineRequest, response: dict[str, Any], item_id: str, pieces: list[str]
) -> None:
    """`response` streamed as vLLM 0.32 streams a text answer: `event:` and `data:`
    frames, no `[DONE]`; each event's keys in alphabetical order, as vLLM writes them."""
    number = 0

    async def event(kind: str, fields: dict[str, Any], more: bool = True) -> None:
        nonlocal number
        data = dict(sorted({**fields, "sequence_number": number, "type": kind}.items()))
        number += 1
        body = f"event: {kind}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"
        await req.send({"type": "http.response.body", "body": body, "more_body": more})

    started = {
        **response,
        "incomplete_details": None,
        "output": [],
        "status": "in_progress",
        "usage": None,
    }
    text = "".join(pieces)
    item: dict[str, Any] = {
        "id": item_id,
        "content": [],
        "role": "assistant",
        "status": "in_progress",
    }
    part = {"content_index": 0, "item_id": item_id, "output_index": 0}
    empty: dict[str, Any] = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    done: dict[str, Any] = {
        "annotations": [],
        "text": text,
        "type": "output_text",
        "logprobs": None,
    }
    await start_stream(req.send)
    await event("response.created", {"response": started})
    await event("response.in_progress", {"response": started})
    item_added = {"item": {**item, "type": "message", "phase": None}, "output_index": 0}
    await event("response.output_item.added", item_added)
    await event("response.content_part.added", {**part, "part": empty})
    for piece in pieces:
        await seq.decode(1)
        await event("response.output_text.delta", {**part, "delta": piece, "logprobs": []})
    await event("response.output_text.done", {**part, "logprobs": [], "text": text})
    await event("response.content_part.done", {**part, "part": done})
    item_done = {**item, "content": [done] if text else [], "status": "completed"}
    item_done = {**item_done, "type": "message", "phase": None}
    await event("response.output_item.done", {"item": item_done, "output_index": 0})
    await event("response.completed", {"response": response}, more=False)


class ResponseStore:
    """One engine's stored responses, by id, and the handlers that use them."""

    def __init__(self) -> None:
        self.stored: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def lookup(self, path: str) -> tuple[str, str] | None:
        """(route label, method) of a `/v1/responses/{id}` path, None for another."""
        rest = path.removeprefix(PATH + "/")
        if rest == path or not rest:
            return None
        if rest.endswith("/cancel") and "/" not in rest.removesuffix("/cancel"):
            return PATH + "/{response_id}/cancel", "POST"
        if "/" not in rest:
            return PATH + "/{response_id}", "GET"
        return None

    async def create(self, engine: Engine, req: Request) -> None:
        body = req.json()
        model, _ = engine.resolve_model(body.get("model"))
        if lax_bool(body.get("background"), "background"):
            raise bad_request("The simulator does not simulate `background`.", "background")
        request_id = body.get("request_id") or f"resp_{secrets.token_hex(16)}"
        if not isinstance(request_id, str):
            raise invalid_body("request_id: Input should be a valid string")
        previous_id = body.get("previous_response_id")
        history: list[str] = []
        if previous_id is not None:
            previous = self.stored.get(previous_id)
            if previous is None:
                raise not_found(previous_id)
            history = _texts(previous["output"])
        texts = [*history, *_texts(body.get("instructions")), *_texts(body.get("input"))]
        if not texts:
            raise invalid_body("input: Field required")
        tokens = tokenizer.encode("\n".join(texts))
        limit = engine.config.max_model_len
        requested = body.get("max_output_tokens")
        if requested is not None and (type(requested) is not int or requested < 1):
            raise invalid_body("max_output_tokens: Input should be an integer of at least 1")
        if len(tokens) + (requested or 1) > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens.", "input")
        max_tokens = requested or limit - len(tokens)
        cached, _ = engine.lookup_prefix(tokens, (), "", "")
        pieces, reason = output(tokens, max_tokens, lax_bool(body.get("ignore_eos"), "ignore_eos"))
        incomplete = reason == "length"
        item_id = f"msg_{secrets.token_hex(16)}"
        response: dict[str, Any] = {
            "id": request_id,
            "created_at": int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": model,
            "object": "response",
            "output": [
                {
                    "id": item_id,
                    "content": [
                        {
                            "annotations": [],
                            "text": "".join(pieces),
                            "type": "output_text",
                            "logprobs": None,
                        }
                    ],
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                    "phase": None,
                }
            ],
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "background": False,
            "max_output_tokens": max_tokens,
            "max_tool_calls": None,
            "previous_response_id": previous_id,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": "incomplete" if incomplete else "completed",
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": _usage(len(tokens), len(pieces), cached),
            "user": None,
            "presence_penalty": None,
            "frequency_penalty": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }
        async with EngineRequest(engine, len(tokens) - cached) as seq:
            seq.finish_reason = reason
            engine.metrics.generation_tokens += len(pieces)
            if lax_bool(body.get("stream"), "stream"):
                await _stream(req, seq, response, item_id, pieces)
            else:
                await seq.decode(len(pieces))
        if body.get("store", True) is not False:
            self.stored[request_id] = response
            self.stored.move_to_end(request_id)
            while len(self.stored) > CAPACITY:
                self.stored.popitem(last=False)
        if not lax_bool(body.get("stream"), "stream"):
            await respond_json(req.send, response)

    async def retrieve(self, engine: Engine, req: Request) -> None:
        response_id = req.path.split("/")[3]
        response = self.stored.get(response_id)
        if response is None:
            raise not_found(response_id)
        if b"stream=true" in req.query.lower():
            raise bad_request("The simulator does not stream stored responses.", "stream")
        await respond_json(req.send, response)

    async def cancel(self, engine: Engine, req: Request) -> None:
        response_id = req.path.split("/")[3]
        if response_id not in self.stored:
            raise not_found(response_id)
        # Every stored response here is finished (no `background`): vLLM's answer.
        raise SimError(
            400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id"
        )
