"""What the gateway asks an engine for, so that every answer can be metered, and how the
answer is read (proxy/usage.py, relayed by proxy/relay.py).

- A stream of /v1/chat/completions, /v1/completions or /invocations asked without
  `stream_options.include_usage` reports no usage: the gateway asks for it, and drops
  `continuous_usage_stats` (vLLM honours it only with `include_usage`: `should_include_usage`
  in vllm/entrypoints/serve/utils/api_utils.py, so the client never got it), then takes
  the usage event out of the answer (`HiddenUsage`).
- `encoding_format: "bytes_only"` on /v1/embeddings, /pooling and /invocations reports no
  usage anywhere: the gateway asks for `"bytes"` (the same body; usage in the `metadata`
  header: `build_pooling_bytes_streaming_response` in vllm/entrypoints/pooling/utils.py)
  and does not relay the header. Refusing `bytes_only` would break clients for nothing.
- `GET /v1/responses/{id}` and its cancel answer a stored response, metered when it was
  made: never metered again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from gateway.access.endpoints import Group, Route

# Routes whose streams carry usage only when asked (`stream_options`).
_STREAM_OPTIONS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations"})
# Routes whose pooling answers may be binary (vLLM's `encoding_format`).
_BINARY_POOLING: Final = frozenset({"/v1/embeddings", "/pooling", "/invocations"})
# Routes whose answers carry keys the client named: parsed whole (proxy/usage.py).
_CLIENT_KEYS: Final = frozenset({"/v1/systemone"})


@dataclass(slots=True)
class Metering:
    """How one request's answer is metered."""

    # False: the answer is never metered (a stored response read again).
    count: bool = True
    # Parse the whole answer for its top-level `usage` (up to usage.WHOLE_LIMIT).
    whole: bool = False
    # The gateway asked for a stream's usage event: take it out of the answer.
    hide_usage: bool = False
    # The gateway asked for `bytes` where the client asked `bytes_only`: the `metadata`
    # header stays behind.
    hide_metadata: bool = False
    # Audio routes: seconds of audio, not tokens.
    audio: bool = False


NOT_METERED: Final = Metering(count=False)


def plan(route: Route, body: dict[str, Any] | None, stored: bool) -> tuple[Metering, bool]:
    """How to meter a request to `route` with `body` (its parsed JSON, changed in
    place), and whether the body was changed. `stored`: the route reads a stored
    response."""
    if stored:
        return NOT_METERED, False
    meter = Metering(whole=route.path in _CLIENT_KEYS, audio=route.group is Group.audio)
    if body is None:
        return meter, False
    changed = False
    path = route.path
    if path in _STREAM_OPTIONS and body.get("stream") is True:
        options = body.get("stream_options")
        if options is None or (type(options) is dict and not options.get("include_usage")):
            # Anything else is left for vLLM to refuse.
            body["stream_options"] = {"include_usage": True}
            meter.hide_usage = changed = True
    if path in _BINARY_POOLING and body.get("encoding_format") == "bytes_only":
        body["encoding_format"] = "bytes"
        meter.hide_metadata = changed = True
    return meter, changed
