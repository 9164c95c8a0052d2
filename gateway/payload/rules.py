"""The tables the body walk applies. Every rule about request fields lives here, so the
JSON walk, the multipart check and the docs read the same lists.

Checked against vLLM 0.32's source (docs/vllm.md, "Where vLLM reads media"): content
parts are TypedDicts and pydantic models that drop unknown keys, and a part's type is
taken from its keys when `type` is missing or a `uuid` is set. So these tables name
keys, never positions: a key is recognised in every object of the body, at any depth,
whatever the object's other keys are.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class OptIn(StrEnum):
    """A refused field or part type that a setting lets through (fields.opted_in
    reads each from its boolean setting: `media.allow_<name>`, `payload.allow_<name>`)."""

    prompt_embeds = "prompt_embeds"
    embeds_parts = "embeds_parts"
    kv_transfer_params = "kv_transfer_params"
    ec_transfer_params = "ec_transfer_params"
    media_io_kwargs = "media_io_kwargs"
    mm_processor_kwargs = "mm_processor_kwargs"
    chat_template = "chat_template"
    pooling_data = "pooling_data"
    priority = "priority"
    background = "background"
    mcp_headers = "mcp_headers"


# A media part's own keys that are never a URL vLLM fetches; any other string on a
# media part that looks like a URL is refused (default deny for shapes vLLM may add).
URLISH_KEYS: Final = frozenset({"url", "uri", "src", "href"})

# Fields refused wherever they sit unless their opt-in is on (None: never).
# Torch deserialization, engine connection steering, processor and template control.
FORBIDDEN_ANYWHERE: Final[dict[str, OptIn | None]] = {
    "prompt_embeds": OptIn.prompt_embeds,
    "image_embeds": OptIn.embeds_parts,
    "audio_embeds": OptIn.embeds_parts,
    "video_embeds": OptIn.embeds_parts,
    "kv_transfer_params": OptIn.kv_transfer_params,
    "ec_transfer_params": OptIn.ec_transfer_params,
    "kv_cache_report_mode": None,
    "media_io_kwargs": OptIn.media_io_kwargs,
    "mm_processor_kwargs": OptIn.mm_processor_kwargs,
    "chat_template": OptIn.chat_template,
    "multi_modal_data": None,
    "multi_modal_uuids": None,
}
# Part types with the same meaning as a forbidden field.
FORBIDDEN_TYPES: Final[dict[str, OptIn]] = {
    "prompt_embeds": OptIn.prompt_embeds,
    "image_embeds": OptIn.embeds_parts,
    "audio_embeds": OptIn.embeds_parts,
    "video_embeds": OptIn.embeds_parts,
}
# Top-level fields refused unless their opt-in is on. Top level only:
# these are common property names in tool schemas, where vLLM never reads them.
FORBIDDEN_TOP_LEVEL: Final[dict[str, OptIn]] = {
    "data": OptIn.pooling_data,
    "priority": OptIn.priority,
}
# Top-level identifiers vLLM shares across everyone on an engine (0.32: `session_id` is
# stamped on the engine's KV cache events): namespaced per key, never forwarded as sent.
# `request_id`, which also names the stored /v1/responses answer, is bound to the key
# in a form the gateway can check later (identity.Identity.response_id).
NAMESPACED_TOP_LEVEL: Final = ("session_id",)
# Form fields of the audio routes with the same meaning as the JSON fields above.
FORBIDDEN_FORM_FIELDS: Final = frozenset(
    {
        *FORBIDDEN_ANYWHERE,
        *FORBIDDEN_TOP_LEVEL,
        *NAMESPACED_TOP_LEVEL,
        "request_id",
        "vllm_xargs",
        "cache_salt",
    }
)

# Lists and objects below the body; tool schemas nest deeper than messages do.
MAX_DEPTH: Final = 64
