"""The gateway's body rules against the shapes the installed vLLM reads media from.

The walk recognises media by key, never by position (gateway/payload/rules.py). These
tests read the keys from vLLM's own code in the engine venv, so an upgrade that teaches
vLLM a new media key or part type fails here instead of slipping past the gateway.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.harness.realvllm.home import Home
from gateway.media.types import MEDIA_KEYS, MEDIA_TYPES
from gateway.payload.rules import FORBIDDEN_ANYWHERE, FORBIDDEN_TYPES

pytestmark = pytest.mark.real_vllm

# Run with the engine venv's interpreter: what vLLM's chat renderer and APIs accept.
_PROBE = r"""
import inspect, json, re, typing
from vllm.renderers import chat_utils as cu
from vllm.entrypoints.generate.structured_decisions.protocol import StructuredDecisionRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

branch = inspect.getsource(cu._parse_chat_message_content_mm_part)
lists = [name for name, field in StructuredDecisionRequest.model_fields.items()
         if "list[str]" in str(field.annotation)]
print(json.dumps({
    "parser_types": sorted(cu.MM_PARSER_MAP),
    "text_types": sorted(cu._TEXT_CONTENT_PART_TYPES),
    "presence_keys": sorted(set(re.findall(r'if "(\w+)" in part', branch))),
    "part_fields": sorted(cu._KNOWN_CONTENT_PART_FIELDS),
    "url_lists": lists,
    "anthropic_source": inspect.getsource(
        AnthropicServingMessages._convert_image_source_to_url),
}))
"""


@pytest.fixture(scope="module")
def shapes(real_home: Home) -> dict[str, object]:
    out = subprocess.run(
        [str(real_home.python), "-c", _PROBE],
        capture_output=True, text=True, timeout=300, check=False,
        env={"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    loaded: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_every_media_part_type_vllm_parses_is_a_media_type_here(shapes: dict[str, object]) -> None:
    media_types = set(shapes["parser_types"]) - set(shapes["text_types"])  # type: ignore[arg-type]
    assert media_types, "found no media part types: the probe no longer reads vLLM"
    assert media_types <= MEDIA_TYPES, media_types - MEDIA_TYPES
    # Each is either media the gateway resolves or a part it refuses outright.
    assert media_types <= set(MEDIA_KEYS) | set(FORBIDDEN_TYPES)


def test_every_key_vllm_infers_a_part_type_from_is_recognised(shapes: dict[str, object]) -> None:
    keys = set(shapes["presence_keys"]) - {"tool_reference"}  # type: ignore[arg-type]
    assert {"image_url", "audio_url", "video_url", "input_audio"} <= keys
    assert keys <= set(MEDIA_KEYS) | set(FORBIDDEN_ANYWHERE)


def test_every_content_part_field_that_can_hold_media_is_recognised(
    shapes: dict[str, object],
) -> None:
    fields = set(shapes["part_fields"])  # type: ignore[arg-type]
    # Fields of vLLM's content part TypedDicts that carry no media (text, ids, options).
    inert = {"type", "text", "thinking", "refusal", "detail", "uuid", "name", "data",
             "signature", "redacted", "closed", "cache_control", "id", "format",
             "prompt_cache_breakpoint"}  # fmt: skip
    unknown = fields - inert - set(MEDIA_KEYS) - set(FORBIDDEN_ANYWHERE)
    assert not unknown, f"vLLM content parts have fields the gateway does not classify: {unknown}"


def test_the_url_lists_of_structured_decisions_are_media_keys(shapes: dict[str, object]) -> None:
    lists = set(shapes["url_lists"])  # type: ignore[arg-type]
    assert {"images", "videos"} <= lists
    assert lists <= set(MEDIA_KEYS)


def test_anthropic_sources_are_read_as_the_walk_assumes(shapes: dict[str, object]) -> None:
    """A `url` source is fetched; any other type is turned into a data URL from `data`
    and `media_type`, which the walk only lets through as a validated base64 source."""
    source = str(shapes["anthropic_source"])
    assert 'source_type == "url"' in source and 'source.get("url"' in source
    assert 'source.get("data"' in source and 'source.get("media_type"' in source
