"""From request bodies to prompt tokens: the chat template and where media hides.

Media parts are found the way vLLM finds them: in every role, typed or untyped, by the
presence of an `image_url` / `video_url` / `audio_url` / `input_audio` key whatever the
`type` says (vllm/entrypoints/chat_utils.py picks the parser by key when `type` is
missing), with the URL given as a string or as `{"url": ...}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.sim import tokenizer
from bench.sim.cache import MediaSpan, block_hashes
from bench.sim.errors import invalid_body
from bench.sim.media import MediaItem, MediaRef

Segment = str | MediaRef

GENERATION_PROMPT = "<|im_start|>assistant\n"

_MEDIA_KEYS = (("image_url", "image"), ("video_url", "video"), ("audio_url", "audio"))
# Parts that carry serialized tensors; a default vLLM torch.load()s them
# (CVE-2025-62164). The simulator refuses them rather than pretend.
_EMBEDS_KEYS = ("image_embeds", "audio_embeds", "video_embeds", "prompt_embeds")


def media_ref(part: dict[str, Any]) -> MediaRef | None:
    uuid = None if part.get("uuid") is None else str(part["uuid"])
    for key, kind in _MEDIA_KEYS:
        if key in part:
            value = part[key]
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str):
                raise invalid_body(f"{key}.url: Input should be a valid string")
            return MediaRef(kind, url, uuid)
    if "input_audio" in part:
        audio = part["input_audio"]
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise invalid_body("input_audio.data: Input should be a valid string")
        fmt = audio.get("format") if isinstance(audio.get("format"), str) else "wav"
        return MediaRef("audio", f"data:audio/{fmt};base64,{audio['data']}", uuid)
    for key in _EMBEDS_KEYS:
        if key in part:
            raise invalid_body(f"The simulator does not accept `{key}` parts.")
    return None


def content_segments(content: Any, where: str) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid_body(f"{where}: Input should be a valid string or list of parts")
    out: list[Segment] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict):
            raise invalid_body(f"{where}: each content part should be an object")
        ref = media_ref(part)
        if ref is not None:
            marker = "vision" if ref.kind != "audio" else "audio"
            out += [f"<|{marker}_start|>", ref, f"<|{marker}_end|>"]
            continue
        for key in ("text", "refusal"):
            text = part.get(key)
            if isinstance(text, str):
                out.append(text)
    return out


def chat_segments(messages: Any, add_generation_prompt: bool = True) -> list[Segment]:
    """The Qwen chat template over `messages`, with media items in place."""
    if not isinstance(messages, list) or not messages:
        raise invalid_body("messages: Input should be a non-empty list")
    out: list[Segment] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_body(f"messages.{index}: each message needs a string `role`")
        out.append(f"<|im_start|>{message['role']}\n")
        out += content_segments(message.get("content"), f"messages.{index}.content")
        out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append(GENERATION_PROMPT)
    return out


def reply_sequence(tokens: Sequence[int], reply: str, block_size: int) -> tuple[list[int], int]:
    """The tokens the engine holds after answering a chat prompt (`tokens`, which end in
    the generation prompt): the prompt, then the reply, as the next turn renders them
    with the reply as an assistant message; and the first block that differs from the
    prompt's. The pseudo-tokenizer cuts text every 4 bytes, so the generation prompt's
    last token differs from the one the next turn gets; vLLM's real tokenizers give
    back the generated ids, so the sim caches what the next turn will send."""
    head = len(tokens) - len(tokenizer.encode(GENERATION_PROMPT))
    tail = tokenizer.encode(f"{GENERATION_PROMPT}{reply}<|im_end|>\n")
    return [*tokens[:head], *tail], head // block_size


def reply_blocks(
    tokens: Sequence[int],
    spans: Sequence[MediaSpan],
    hashes: Sequence[bytes],
    reply: str,
    block_size: int,
    lora: str = "",
    salt: str = "",
) -> list[bytes]:
    """The hashes of the blocks a chat reply adds after its prompt (`tokens`, whose block
    `hashes` are known): only the blocks from the generation prompt on are hashed, the
    chain continuing from the prompt's last block before it."""
    sequence, start = reply_sequence(tokens, reply, block_size)
    parent = hashes[start - 1] if start else b""
    return block_hashes(sequence, spans, block_size, lora, salt, start=start, parent=parent)


def media_refs(segments: Sequence[Segment]) -> list[MediaRef]:
    return [s for s in segments if isinstance(s, MediaRef)]


def assemble(
    segments: Sequence[Segment], items: Sequence[MediaItem]
) -> tuple[list[int], list[MediaSpan]]:
    """Token ids and media spans. Text between media items is tokenized as one run, so
    the same message text always gives the same tokens whatever follows it."""
    tokens: list[int] = []
    spans: list[MediaSpan] = []
    pending: list[str] = []
    media = iter(items)
    for segment in segments:
        if isinstance(segment, str):
            pending.append(segment)
            if segment.endswith("<|im_end|>\n"):
                tokens += tokenizer.encode("".join(pending))
                pending.clear()
            continue
        if pending:
            tokens += tokenizer.encode("".join(pending))
            pending.clear()
        item = next(media)
        start = len(tokens)
        tokens += [tokenizer.placeholder(item.kind)] * item.tokens
        spans.append(MediaSpan(start, len(tokens), item.digest))
    if pending:
        tokens += tokenizer.encode("".join(pending))
    return tokens, spans


def completion_prompts(prompt: Any) -> list[list[int]]:
    """`prompt` of /v1/completions: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(tokenizer.valid_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(tokenizer.valid_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise invalid_body("prompt: Input should be a string, a list of strings or token ids")


def text_inputs(value: Any, field: str) -> list[str]:
    """`input` of the pooling routes: a string, a list of strings, or token ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(tokenizer.valid_id(t) for t in value):
            return [tokenizer.decode(value)]
        if all(isinstance(v, list) and all(tokenizer.valid_id(t) for t in v) for v in value):
            return [tokenizer.decode(v) for v in value]
    raise invalid_body(f"{field}: Input should be a string, a list of strings or token ids")
