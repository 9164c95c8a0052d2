"""Generation routes: /v1/chat/completions, /v1/completions, /tokenize, /detokenize.

Bodies follow vllm/entrypoints/openai/{chat_completion,completion}/protocol.py; usage
always carries `prompt_tokens_details.cached_tokens` (vLLM does so with
`--enable-prompt-tokens-details`, which the gateway's tests rely on).
"""

from __future__ import annotations

import time
from typing import Any

from bench.sim import prompt, tokenizer
from bench.sim.config import VERSION
from bench.sim.engine import Engine, EngineRequest
from bench.sim.errors import bad_request, invalid_body
from bench.sim.http import Request, end_stream, respond_json, send_event, start_stream

# Output text: 4-character pieces, so one piece is one token of the pseudo-tokenizer.
_PIECES = (
    " The", " sim", "ulat", "ed e", "ngin", "e an", "swer", "s wi", "th d", "eter",
    "mini", "stic", " tex", "t; n", "o mo", "del ", "ran.",
)  # fmt: skip


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise invalid_body(f"{name}: Input should be an integer of at least {minimum}")
    return value


# What pydantic v2 in lax mode reads as a boolean string, in any case (vLLM's request
# models): measured against pydantic 2.14.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: object, name: str) -> bool:
    """`value` as vLLM's pydantic reads a `bool | None = False` field."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int | float) and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise invalid_body(f"{name}: Input should be a valid boolean")


def _bool_field(body: dict[str, Any], name: str) -> bool:
    return lax_bool(body.get(name), name)


def _salt(body: dict[str, Any]) -> str:
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise invalid_body("Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def _include_usage(body: dict[str, Any]) -> tuple[bool, bool]:
    """(the usage event at the end, usage in every chunk): vLLM's `should_include_usage`,
    which honours `continuous_usage_stats` only with `include_usage`."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise invalid_body("stream_options: Input should be a valid dictionary")
    include = lax_bool(options.get("include_usage"), "stream_options.include_usage")
    continuous = lax_bool(
        options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats"
    )
    return include, include and continuous


def _chunk_usage(prompt_tokens: int, completion: int) -> dict[str, Any]:
    """A chunk's usage with `continuous_usage_stats`, as vLLM 0.32 writes it."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
    }


def _max_tokens(engine: Engine, body: dict[str, Any], prompt_len: int) -> int:
    limit = engine.config.max_model_len
    requested = _int_field(body, "max_completion_tokens", 1)
    if requested is None:
        requested = _int_field(body, "max_tokens", 1)
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the "
            "input messages.",
            "messages",
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {requested} output tokens and your prompt contains {prompt_len} "
            f"input tokens, for a total of {prompt_len + requested} tokens. Please reduce "
            "the length of the input prompt or the number of requested output tokens.",
            "max_tokens",
        )
    return requested


def output(tokens: list[int], max_tokens: int, ignore_eos: bool) -> tuple[list[str], str]:
    """Deterministic output pieces for a prompt, and the finish reason."""
    seed = hash((len(tokens), *tokens[-8:])) & 0x7FFFFFFF
    natural = 8 + seed % 25
    count = max_tokens if ignore_eos else min(natural, max_tokens)
    reason = "length" if ignore_eos or natural > max_tokens else "stop"
    pieces = [_PIECES[(seed + i) % len(_PIECES)] for i in range(count)]
    return pieces, reason


def _usage(prompt_tokens: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": None,
    }


# Fields vLLM 0.32 puts in every non-streamed answer, null unless asked for
# (tests/real/test_fidelity.py compares the keys with the real engine's).
RESPONSE_NULLS = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
CHOICE_NULLS = {"stop_reason": None, "token_ids": None, "routed_experts": None}
FINGERPRINT = {"system_fingerprint": f"vllm-{VERSION}-sim"}


# The vocabulary size the simulator reports for out-of-vocabulary ids (Qwen3's).
VOCAB_SIZE = 151936


def _check_logit_bias(body: dict[str, Any]) -> None:
    """vLLM's check (`SamplingParams._validate_logit_bias`), with its message."""
    bias = body.get("logit_bias")
    if not isinstance(bias, dict):
        return
    invalid = [int(k) for k in bias if k.lstrip("-").isdigit() and not 0 <= int(k) < VOCAB_SIZE]
    if invalid:
        raise bad_request(
            f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. "
            f"Vocabulary size: {VOCAB_SIZE}",
            "logit_bias",
        )


async def chat(engine: Engine, req: Request) -> None:
    body = req.json()
    model, lora = engine.resolve_model(body.get("model"))
    _check_logit_bias(body)
    stream = _bool_field(body, "stream")
    add_generation_prompt = body.get("add_generation_prompt", True) is not False
    segments = prompt.chat_segments(body.get("messages"), add_generation_prompt)
    items = await engine.load_media(prompt.media_refs(segments))
    tokens, spans = prompt.assemble(segments, items)
    max_tokens = _max_tokens(engine, body, len(tokens))
    include_usage, continuous = _include_usage(body)
    ignore_eos = _bool_field(body, "ignore_eos")
    salt = _salt(body)
    cached, hashes = engine.lookup_prefix(tokens, spans, lora, salt)
    pieces, reason = output(tokens, max_tokens, ignore_eos)
    usage = _usage(len(tokens), len(pieces), cached)
    rid = engine.request_id(req.header(b"x-request-id"))
    head = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time())}

    def cache_reply() -> None:
        if add_generation_prompt:
            engine.cache_reply(tokens, spans, hashes, "".join(pieces), lora, salt)

    async with EngineRequest(engine, len(tokens) - cached, items) as seq:
        seq.finish_reason = reason
        engine.metrics.generation_tokens += len(pieces)
        if not stream:
            await seq.decode(len(pieces))
            cache_reply()
            message: dict[str, Any] = {
                "role": "assistant",
                "content": "".join(pieces),
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": reason,
                **CHOICE_NULLS,
            }
            await respond_json(
                req.send,
                {
                    **head,
                    "model": model,
                    "choices": [choice],
                    "service_tier": None,
                    **FINGERPRINT,
                    "usage": usage,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    # The rendered prompt, after usage, as vLLM 0.32 places it.
                    "prompt_text": (
                        "".join(s for s in segments if isinstance(s, str))
                        if _bool_field(body, "return_prompt_text")
                        else None
                    ),
                    **RESPONSE_NULLS,
                },
            )
            return
        head = {**head, "object": "chat.completion.chunk", "model": model}
        await start_stream(req.send)
        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        counts: dict[str, Any] = {}
        if continuous:
            counts = {"usage": {**_chunk_usage(len(tokens), 0), "completion_tokens_details": None}}
        await send_event(req.send, {**head, "choices": [first], **counts})
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            await seq.decode(1)
            choice = {
                "index": 0,
                "delta": {"content": piece},
                "logprobs": None,
                "finish_reason": reason if i == last else None,
            }
            if i == last:
                choice["stop_reason"] = None
            if continuous:
                counts = {
                    "usage": {**_chunk_usage(len(tokens), i + 1), "completion_tokens_details": None}
                }
            await send_event(req.send, {**head, "choices": [choice], **counts})
        cache_reply()
        if include_usage:
            await send_event(req.send, {**head, "choices": [], "usage": usage, **FINGERPRINT})
        await end_stream(req.send)


async def completions(engine: Engine, req: Request) -> None:
    body = req.json()
    model, lora = engine.resolve_model(body.get("model"))
    stream = _bool_field(body, "stream")
    if "prompt_embeds" in body:
        raise bad_request("The simulator does not accept `prompt_embeds`.", "prompt_embeds")
    prompts = prompt.completion_prompts(body.get("prompt"))
    include_usage, continuous = _include_usage(body)
    ignore_eos = _bool_field(body, "ignore_eos")
    salt = _salt(body)
    results = []
    total_prompt = total_cached = 0
    for tokens in prompts:
        max_tokens = _max_tokens(engine, body, len(tokens))
        cached, _ = engine.lookup_prefix(tokens, (), lora, salt)
        results.append(output(tokens, max_tokens, ignore_eos))
        total_prompt += len(tokens)
        total_cached += cached
    total_out = sum(len(p) for p, _ in results)
    usage = _usage(total_prompt, total_out, total_cached)
    rid = engine.request_id(req.header(b"x-request-id"))
    head = {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    async with EngineRequest(engine, total_prompt - total_cached) as seq:
        seq.finish_reason = results[-1][1]
        engine.metrics.generation_tokens += total_out
        if not stream:
            await seq.decode(max(len(p) for p, _ in results))
            choices = [
                {
                    "index": i,
                    "text": "".join(pieces),
                    "logprobs": None,
                    "finish_reason": reason,
                    **CHOICE_NULLS,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                }
                for i, (pieces, reason) in enumerate(results)
            ]
            await respond_json(
                req.send,
                {
                    **head,
                    "choices": choices,
                    "service_tier": None,
                    **FINGERPRINT,
                    "usage": usage,
                    **RESPONSE_NULLS,
                },
            )
            return
        await start_stream(req.send)
        for index, (pieces, reason) in enumerate(results):
            last = len(pieces) - 1
            for i, piece in enumerate(pieces):
                await seq.decode(1)
                choice = {
                    "index": index,
                    "text": piece,
                    "logprobs": None,
                    "finish_reason": reason if i == last else None,
                    "stop_reason": None,
                }
                event: dict[str, Any] = {**head, "choices": [choice]}
                if continuous:
                    event["usage"] = _chunk_usage(len(prompts[index]), i + 1)
                await send_event(req.send, event)
        if include_usage:
            await send_event(req.send, {**head, "choices": [], "usage": usage, **FINGERPRINT})
        await end_stream(req.send)


async def tokenize(engine: Engine, req: Request) -> None:
    body = req.json()
    engine.resolve_model(body.get("model"))
    if "messages" in body:
        # Like vLLM, /tokenize renders the chat and so fetches its media, and it is not
        # guarded by --api-key (docs/vllm.md).
        segments = prompt.chat_segments(
            body["messages"], body.get("add_generation_prompt", True) is not False
        )
        items = await engine.load_media(prompt.media_refs(segments))
        tokens, _ = prompt.assemble(segments, items)
    elif isinstance(body.get("prompt"), str):
        tokens = tokenizer.encode(body["prompt"])
    else:
        raise invalid_body("Either `prompt` (a string) or `messages` is required.")
    strs = [tokenizer.decode([t]) for t in tokens] if body.get("return_token_strs") else None
    await respond_json(
        req.send,
        {
            "count": len(tokens),
            "max_model_len": engine.config.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        },
    )


async def detokenize(engine: Engine, req: Request) -> None:
    body = req.json()
    engine.resolve_model(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(tokenizer.valid_id(t) for t in tokens):
        raise invalid_body("tokens: Input should be a list of valid token ids")
    await respond_json(req.send, {"prompt": tokenizer.decode(tokens)})
