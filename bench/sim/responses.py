"""/v1/responses with vLLM's response store (`--enable-responses-api-store`, what
`VLLM_ENABLE_RESPONSES_API_STORE=1` turns on in vLLM).

`POST /v1/responses` generates and, with `store` (true unless the body says false),
keeps the answer under the body's `request_id` (vLLM's own default: `resp_` + a random
id); `GET /v1/responses/{id}` reads it back, `POST /v1/responses/{id}/cancel` answers as
vLLM does for a finished one, and `previous_response_id` must name a stored response.
Like vLLM, the store is one dict per engine process: nothing is shared between engines
or kept across a restart. Shapes of vllm/entrypoints/openai/responses (0.32:
`ResponsesResponse.from_request`, `_make_not_found_error`). Not simulated: streaming,
`background`, tools.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any

from bench.sim import tokenizer
from bench.sim.engine import Engine, EngineRequest
from bench.sim.errors import SimError, bad_request, invalid_body
from bench.sim.generate import lax_bool, output
from bench.sim.http import Request, respond_json

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
        for field in ("stream", "background"):
            if lax_bool(body.get(field), field):
                raise bad_request(f"The simulator does not simulate `{field}`.", field)
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
        pieces, reason = output(tokens, max_tokens, False)
        async with EngineRequest(engine, len(tokens) - cached) as seq:
            seq.finish_reason = reason
            engine.metrics.generation_tokens += len(pieces)
            await seq.decode(len(pieces))
        incomplete = reason == "length"
        response = {
            "id": request_id,
            "created_at": int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": model,
            "object": "response",
            "output": [
                {
                    "id": f"msg_{secrets.token_hex(16)}",
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
        if body.get("store", True) is not False:
            self.stored[request_id] = response
            self.stored.move_to_end(request_id)
            while len(self.stored) > CAPACITY:
                self.stored.popitem(last=False)
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
