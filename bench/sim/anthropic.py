"""/v1/messages, Anthropic's Messages API as vLLM 0.32 serves it (vllm/entrypoints/anthropic/).

vLLM turns the request into a chat completion and its answer back; its usage is split as
Anthropic's is (`_build_anthropic_usage`): `input_tokens` is the prompt less its cached
tokens, `cache_read_input_tokens` the cached ones (vLLM reports them with
`--enable-prompt-tokens-details`, which the simulator always does). A stream is always
asked with usage (`include_usage` and `continuous_usage_stats`): `message_start` carries
the first chunk's usage, the whole prompt as `input_tokens` (a chunk's usage has no
prompt-token details, so nothing is split off), and `message_delta` the final one.
"""

from __future__ import annotations

from typing import Any

import orjson

from bench.sim import prompt
from bench.sim.engine import Engine, EngineRequest
from bench.sim.errors import invalid_body
from bench.sim.generate import lax_bool, output
from bench.sim.http import Request, respond_json, start_stream


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's `system` and `messages` as chat messages (text blocks joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_body("messages: Input should be a non-empty list")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        chat.append({"role": "system", "content": system})
    for message in messages:
        if not isinstance(message, dict):
            raise invalid_body("messages: each message should be an object")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                b.get("text", "")
                for b in content
                if isinstance(b, dict) and b.get("type") == "text"
            )
        chat.append({"role": message.get("role"), "content": content})
    return chat


def usage(prompt_tokens: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
    }


async def _event(req: Request, name: str, data: dict[str, Any]) -> None:
    await req.send(
        {
            "type": "http.response.body",
            "body": f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n",
            "more_body": True,
        }
    )


async def messages(engine: Engine, req: Request) -> None:
    body = req.json()
    model, lora = engine.resolve_model(body.get("model"))
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        raise invalid_body("max_tokens: Input should be an integer of at least 1")
    segments = prompt.chat_segments(_messages(body))
    tokens, spans = prompt.assemble(segments, [])
    cached, _ = engine.lookup_prefix(tokens, spans, lora, "")
    pieces, reason = output(tokens, max_tokens, False)
    stop = "max_tokens" if reason == "length" else "end_turn"
    rid = engine.request_id(req.header(b"x-request-id"))
    async with EngineRequest(engine, len(tokens) - cached) as seq:
        seq.finish_reason = reason
        engine.metrics.generation_tokens += len(pieces)
        if not lax_bool(body.get("stream"), "stream"):
            await seq.decode(len(pieces))
            await respond_json(
                req.send,
                {
                    "id": f"chatcmpl-{rid}",
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "text", "text": "".join(pieces)}],
                    "model": model,
                    "stop_reason": stop,
                    "stop_sequence": None,
                    "usage": {
                        **usage(len(tokens), len(pieces), cached),
                        "cache_creation_input_tokens": None,
                    },
                    "kv_transfer_params": None,
                    "ec_transfer_params": None,
                },
            )
            return
        await start_stream(req.send)
        start: dict[str, Any] = {
            "id": f"chatcmpl-{rid}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(tokens), "output_tokens": 0},
        }
        await _event(req, "message_start", {"type": "message_start", "message": start})
        block = {"type": "text", "text": ""}
        await _event(
            req,
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )
        for piece in pieces:
            await seq.decode(1)
            delta = {"type": "text_delta", "text": piece}
            await _event(
                req,
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": delta},
            )
        await _event(req, "content_block_stop", {"type": "content_block_stop", "index": 0})
        await _event(
            req,
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": usage(len(tokens), len(pieces), cached),
            },
        )
        await req.send(
            {
                "type": "http.response.body",
                "body": b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
                "more_body": False,
            }
        )
