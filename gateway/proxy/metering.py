"""What the gateway asks an engine for, so that every answer can be metered, and how the
answer is read (proxy/usage.py, relayed by proxy/relay.py).

- A stream of /v1/chat/completions, /v1/completions or /invocations reports its usage
  only when asked (`stream_options.include_usage`), and only at its end; with
  `continuous_usage_stats` as well, every chunk carries the prompt's and the choice's
  counts so far (`should_include_usage` in vllm/entrypoints/serve/utils/api_utils.py;
  the chunks: `chat_completion_stream_generator` and `completion_stream_generator`).
  The gateway asks for both, and takes out of the answer what the client did not ask
  for (`EventUsage`): a client that leaves early is metered the last counts it was
  sent. `stream`, `include_usage` and `continuous_usage_stats` are read as vLLM's
  pydantic reads them (payload/lax.py: `"true"` and `1` are true), so a stream is
  never taken for an answer that reports its usage unasked.
- A stream of /v1/messages or /v1/responses reports its usage only in its final events
  (`message_delta`, `response.completed`): its events are read as they pass
  (`usage.Steps`), so that one cut short is metered what came before them.
- /v1/systemone's answer is parsed whole for its usage: a request whose answer could
  be too large for that is refused (payload/decisions.py).
- `encoding_format: "bytes_only"` on /v1/embeddings, /pooling and /invocations reports no
  usage anywhere: the gateway asks for `"bytes"` (the same body; usage in the `metadata`
  header: `build_pooling_bytes_streaming_response` in vllm/entrypoints/pooling/utils.py)
  and does not relay the header. Refusing `bytes_only` would break clients for nothing.
- `GET /v1/responses/{id}` and its cancel answer a stored response, metered when it was
  made: never metered again.
- A transcription or translation answered 2xx is metered seconds of audio: the file's,
  as the gateway measured it from its headers before the engine saw it
  (gateway/media/duration.py), whatever the response format and whether it streams.
  vLLM 0.32 reports seconds in some formats only (`usage.seconds` rounded up, or
  `verbose_json`'s `duration`), and the client picks the format: the engine's count is
  taken only when larger (a FLAC or MP4 that declares less than it holds; the rounding).
  A file the gateway cannot time (`media.allow_unknown_duration`) is metered the
  engine's count, or `media.max_audio_seconds` when the answer has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from gateway.access.endpoints import Group, Route
from gateway.errors import InvalidRequest
from gateway.payload.decisions import check_echoes
from gateway.payload.lax import lax_bool

# Routes whose streams carry usage only when asked (`stream_options`).
_STREAM_OPTIONS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations"})
# Routes whose pooling answers may be binary (vLLM's `encoding_format`).
_BINARY_POOLING: Final = frozenset({"/v1/embeddings", "/pooling", "/invocations"})
# Routes whose answers carry keys the client named: parsed whole (proxy/usage.py).
_CLIENT_KEYS: Final = frozenset({"/v1/systemone"})
# Routes whose streams report their usage only at their end, in events of their own.
_STEP_STREAMS: Final = frozenset({"/v1/messages", "/v1/responses"})


@dataclass(slots=True)
class Metering:
    """How one request's answer is metered."""

    # False: the answer is never metered (a stored response read again).
    count: bool = True
    # Parse the whole answer for its top-level `usage` (up to usage.WHOLE_LIMIT).
    whole: bool = False
    # A stream of chunks that report usage (chat or completion): read event by event.
    events: bool = False
    # A stream (an SSE answer) whose events before its usage are counted (usage.Steps).
    steps: bool = False
    # The gateway asked for a stream's usage event: take it out of the answer.
    hide_usage: bool = False
    # The gateway asked for every chunk's usage: take it out of each chunk.
    hide_chunk_usage: bool = False
    # Choices a prompt makes (`n`, when it reads as an int): the chunks' counts of one
    # prompt's choices share its prompt tokens.
    choices: int = 1
    # One prompt, one choice: the chunks' counts are the last chunk's.
    single: bool = False
    # The gateway asked for `bytes` where the client asked `bytes_only`: the `metadata`
    # header stays behind.
    hide_metadata: bool = False
    # Audio routes: seconds of audio, not tokens.
    audio: bool = False
    # The upload's seconds as the gateway measured them; None: unknown.
    seconds: float | None = None
    # What an upload of unknown length is metered when its answer reports no seconds.
    unknown_seconds: float = 0.0

    def audio_seconds(self, reported: float | None) -> float:
        """The seconds an audio answer is metered, given those the engine's answer
        `reported` (None: none): never less than the gateway's own measure."""
        if self.seconds is None:
            return self.unknown_seconds if reported is None else reported
        return self.seconds if reported is None else max(self.seconds, reported)


NOT_METERED: Final = Metering(count=False)
# A JSON request answered in one piece with its usage, as the engine writes it: one
# shared plan (never changed), no object made per request.
_PLAIN: Final = Metering()


def plan(
    route: Route,
    body: dict[str, Any] | None,
    stored: bool,
    *,
    seconds: float | None = None,
    unknown_seconds: float = 0.0,
) -> tuple[Metering, bool]:
    """How to meter a request to `route` with `body` (its parsed JSON, changed in
    place), and whether the body was changed. `stored`: the route reads a stored
    response. `seconds`: an upload's, as measured (None: unknown, then metered as
    `unknown_seconds` unless the answer reports its own). Raises InvalidRequest for a
    body whose answer could not be metered."""
    if stored:
        return NOT_METERED, False
    path = route.path
    stream: bool | None = False
    if body is not None and path in _STREAM_OPTIONS:
        value = body.get("stream")
        stream = value is not None and value is not False and lax_bool(value, "stream")
    if (
        body is not None
        and not stream
        and path not in _CLIENT_KEYS
        and path not in _STEP_STREAMS
        and route.group is not Group.audio
        and (path not in _BINARY_POOLING or body.get("encoding_format") != "bytes_only")
    ):
        return _PLAIN, False
    meter = Metering(
        whole=path in _CLIENT_KEYS,
        steps=path in _STEP_STREAMS,
        audio=route.group is Group.audio,
    )
    if meter.audio:
        meter.seconds = seconds
        meter.unknown_seconds = unknown_seconds
    if body is None:
        return meter, False
    changed = False
    if stream:
        changed = _ask_usage(path, body, meter)
    if path in _CLIENT_KEYS:
        check_echoes(body)
    if path in _BINARY_POOLING and body.get("encoding_format") == "bytes_only":
        body["encoding_format"] = "bytes"
        meter.hide_metadata = changed = True
    return meter, changed


def _ask_usage(path: str, body: dict[str, Any], meter: Metering) -> bool:
    """Asks a stream for its usage in every chunk and at its end; whether the body
    changed."""
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif type(options) is not dict:
        raise InvalidRequest("`stream_options` must be an object.", param="stream_options")
    include = lax_bool(options.get("include_usage"), "stream_options.include_usage")
    continuous = lax_bool(
        options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats"
    )
    meter.events = True
    meter.hide_usage = not include
    # vLLM honours `continuous_usage_stats` only with `include_usage`.
    meter.hide_chunk_usage = not (include and continuous)
    n = body.get("n")
    meter.choices = n if type(n) is int and n > 1 else 1
    meter.single = meter.choices == 1 and n in (None, 1) and _one_prompt(path, body)
    if include and continuous:
        return False
    # Other keys are kept: vLLM's StreamOptions allows extra fields.
    body["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
    return True


def _one_prompt(path: str, body: dict[str, Any]) -> bool:
    """Whether a chat or completion body asks about one prompt: a chat's conversation, a
    completion's string or token list (vLLM's CompletionRequest `prompt`), no
    `prompt_embeds`. A `messages` key says nothing on the other routes: vLLM's
    CompletionRequest ignores it, and /invocations runs a body whose `messages` chat
    cannot read as a completion."""
    if path == "/v1/chat/completions":
        return True
    if body.get("prompt_embeds") is not None:
        return False
    if "prompt" not in body:
        return "messages" in body
    prompt = body.get("prompt")
    if type(prompt) is str:
        return True
    return type(prompt) is list and len(prompt) > 0 and (len(prompt) == 1 or type(prompt[0]) is int)
