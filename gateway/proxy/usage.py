"""Token counts from an engine's answer, one reader per shape the answer comes in.

What vLLM 0.32 reports, and where (the table of routes: docs/gateway.md, "Metering"):
- A JSON answer's top-level `usage` object. The answer is parsed whole (`parse_usage`)
  when the gateway holds it whole anyway (up to 64 KiB: proxy/relay.py), and for routes
  whose answers carry keys the client named (/v1/systemone's `answers` and
  `diagnostics`, keyed by question id, come around `usage`) up to `WHOLE_LIMIT`: a
  search for the last `"usage":` key there finds a question named `usage`.
- A larger JSON answer of another route, and every stream: the last `"usage":` key of the
  bytes as they pass (`Tail`): a chat answer's `prompt_text` or `prompt_logprobs` and a
  Responses stream's echoed `user` can follow `usage` for longer than any fixed tail, and
  none of those carries a key the client named. Only the `usage` object is parsed.
- A usage object means (`usage_of`): `prompt_tokens` and `completion_tokens` (OpenAI
  shapes), `input_tokens` and `output_tokens` (Responses, /v1/systemone), Cohere's
  `tokens` object, and Anthropic's (/v1/messages) `input_tokens` plus
  `cache_read_input_tokens` plus `cache_creation_input_tokens`: vLLM's Anthropic
  `input_tokens` is the prompt less its cached and newly cached tokens
  (`_build_anthropic_usage` in vllm/entrypoints/anthropic/serving.py).
- A binary pooling answer (`encoding_format: bytes`): the `metadata` response header's
  JSON (`build_pooling_bytes_streaming_response` in vllm/entrypoints/pooling/utils.py).
- Transcriptions and translations: the seconds of audio the answer reports (`usage:
  {"type": "duration", "seconds": n}`, or `duration` in verbose_json), read by
  `audio_seconds`; what is metered is decided with the gateway's own measure
  (proxy/metering.py).
- A chat or completion stream: the gateway asks for the usage event at its end and for
  every chunk's counts so far (proxy/metering.py); `EventUsage` reads them and takes out
  what the client did not ask for, before the client sees it.
- A /v1/messages or /v1/responses stream reports its usage in its last events only
  (`message_delta`, `response.completed`); `Steps` reads what came before them, for a
  stream cut short.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.exchange import Usage

# Bytes at the end of an answer searched for its `usage`: the usage event of a stream
# (about 300 bytes) and what follows it, with room to spare.
TAIL = 4096
# The largest answer held whole to be parsed for its usage (routes whose answers carry
# client-named keys); the answer is relayed as it comes all the same. /v1/systemone
# answers ~150 bytes a question.
WHOLE_LIMIT = 4 * 1024 * 1024
_KEY = b'"usage":'
_SPACE = b" \t\r\n"
_SPACE_BYTES = (b" ", b"\t", b"\r", b"\n")
# Occurrences of `"usage":` tried from the end (one inside a string, or not followed by
# an object, is skipped).
_MAX_TRIES = 4
# SSE events are separated by a blank line; JSON escapes newlines inside strings, so this
# never occurs inside an event's data.
_EVENT_END = b"\n\n"
_DATA = b"data: "
_EVENT = b"event: "
_KEY_LEN = len(_KEY)
_EVENT_END_LEN = len(_EVENT_END)
_DATA_LEN = len(_DATA)
# Anthropic's prompt counts besides `input_tokens`.
_PROMPT_PARTS = ("cache_read_input_tokens", "cache_creation_input_tokens")
_COMMA = ord(",")
_OPEN = ord("{")
# A chunk in vLLM's layout: `usage` its last key after a list of choices that is not
# empty (the usage event that ends a stream has none), `,"usage":{...}` closed by the
# first `}` that is followed by the `}` closing the event and the blank line. In JSON
# that can only be the top-level key's flat object: a nested object's `}` is followed by
# `,` or a second `}`, and a string holds no newline. The bytes are split at the key, not
# searched with a regular expression: `re` costs ~20 instructions a byte (callgrind), a
# split ~3, and a Python loop ~6K a chunk against ~3K for comprehensions.
_CHUNK_KEY = b'}],"usage":{'
_CHUNK_END = b"}\n\n"
_CHUNK_END_LEN = len(_CHUNK_END)
_CHOICES_END = b"}]"
_USAGE_KEY = b',"usage":{'


def _count(value: Any) -> int | None:
    if type(value) is float and value.is_integer():
        # Cohere's chat answers type their counts as floats (`32.0`).
        value = int(value)
    return value if type(value) is int and value >= 0 else None


def usage_of(usage: Any) -> Usage | None:
    """(prompt tokens, completion tokens) of a usage object, None when it holds neither.
    Completion tokens are 0 when absent (pooling answers)."""
    if type(usage) is not dict:
        return None
    if (
        "tokens" not in usage
        and "cache_read_input_tokens" not in usage
        and "cache_creation_input_tokens" not in usage
    ):
        # The OpenAI shape, as the general reading below reads it.
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if type(prompt) is int and type(completion) is int and prompt >= 0 and completion >= 0:
            return prompt, completion
    get = usage.get
    if type(usage.get("tokens")) is dict:
        # Cohere's chat API: {"tokens": {"input_tokens", "output_tokens"}, "billed_units"}.
        get = usage["tokens"].get
    prompt = _count(get("prompt_tokens", get("input_tokens")))
    completion = _count(get("completion_tokens", get("output_tokens")))
    if prompt is None and completion is None:
        return None
    prompt = prompt or 0
    # Anthropic's usage: the prompt is split into three counts (never set elsewhere).
    for part in _PROMPT_PARTS:
        value = get(part)
        if value is not None:
            prompt += _count(value) or 0
    return prompt, completion or 0


def parse_usage(data: bytes) -> Usage | None:
    """The usage of a whole JSON answer: its top-level `usage` object."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return usage_of(answer.get("usage")) if type(answer) is dict else None


def metadata_usage(header: bytes) -> Usage | None:
    """The usage of a binary pooling answer, from its `metadata` header's JSON."""
    return parse_usage(header)


def audio_seconds(data: bytes) -> float | None:
    """Seconds of audio a transcription or translation answer reports: `usage.seconds`
    (`type: duration`, rounded up by vLLM) or, in verbose_json, `duration`."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if type(answer) is not dict:
        return None
    usage = answer.get("usage")
    if type(usage) is dict and usage.get("type") == "duration":
        seconds = usage.get("seconds")
    else:
        seconds = answer.get("duration")
    if type(seconds) is int or type(seconds) is float:
        return float(seconds) if 0 <= seconds < float("inf") else None
    return None


def _object_end(data: bytes, start: int) -> int:
    """The index after the `}` closing the object that opens at `data[start]`, or -1.
    A usage object holds numbers, nulls and small objects of numbers: no strings, so
    braces are counted as they come."""
    depth = 0
    pos = start
    while True:
        close = data.find(b"}", pos)
        if close < 0:
            return -1
        depth += data.count(b"{", pos, close) - 1
        if depth <= 0:
            return close + 1
        pos = close + 1


def read_usage(data: bytes) -> Usage | None:
    """The usage (`usage_of`) of the last `"usage": {...}` key in `data`; None when
    there is none, or it cannot be read."""
    end = len(data)
    for _ in range(_MAX_TRIES):
        at = data.rfind(_KEY, 0, end)
        if at < 0:
            return None
        end = at
        # A key, not text inside a string: a quote inside a JSON string is escaped, so
        # only a quote that opens a key follows `{` or `,`.
        before = at - 1
        while before >= 0 and data[before] in _SPACE:
            before -= 1
        if before < 0 or data[before] not in b"{,":
            continue
        value = at + len(_KEY)
        while data[value : value + 1] in _SPACE_BYTES:
            value += 1
        if data[value : value + 1] != b"{":
            continue
        close = _object_end(data, value)
        if close < 0:
            return None
        try:
            usage = orjson.loads(data[value:close])
        except orjson.JSONDecodeError:
            return None
        return usage_of(usage)
    return None


class Tail:
    """The usage a streamed answer reported last. Its last bytes, at least `TAIL` of them
    once that many came, are kept as they arrive and joined only every `2 * TAIL` bytes,
    so a chunk costs a list append; a chunk of `TAIL` bytes or more replaces what was
    kept, uncopied. Bytes about to be dropped are searched first (with what follows them,
    up to `TAIL` bytes, so an object cut by the drop is whole), so a usage object
    followed by more than `TAIL` bytes (a Responses stream's `response.completed` event
    echoes the request's `user` after it) is still found. The usage in the bytes kept at
    the end, if any, is the last one; else the last one found before."""

    __slots__ = ("_chunks", "_seen", "_size")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._seen: Usage | None = None

    def _search(self, data: bytes) -> None:
        found = read_usage(data)
        if found is not None:
            self._seen = found

    def add(self, chunk: bytes) -> None:
        size = len(chunk)
        if size >= TAIL:
            if self._chunks:
                self._search(b"".join(self._chunks) + chunk[:TAIL])
            self._chunks = [chunk]
            self._size = size
            return
        self._chunks.append(chunk)
        self._size += size
        if self._size > 2 * TAIL:
            joined = b"".join(self._chunks)
            self._search(joined)
            kept = joined[-TAIL:]
            self._chunks = [kept]
            self._size = len(kept)

    def usage(self) -> Usage | None:
        found = read_usage(b"".join(self._chunks))
        return found if found is not None else self._seen


class Whole:
    """An answer held whole (up to `WHOLE_LIMIT`) as it is relayed, parsed at its end."""

    __slots__ = ("_chunks", "_size")

    def __init__(self) -> None:
        self._chunks: list[bytes] | None = []
        self._size = 0

    def add(self, chunk: bytes) -> None:
        if self._chunks is None:
            return
        self._size += len(chunk)
        if self._size > WHOLE_LIMIT:
            # Not metered: said in the log by the caller.
            self._chunks = None
        else:
            self._chunks.append(chunk)

    def body(self) -> bytes | None:
        """The whole answer, None when it was over `WHOLE_LIMIT`."""
        return None if self._chunks is None else b"".join(self._chunks)


def _usage_span(event: bytes, at: int = 0) -> tuple[int, int, int, int] | None:
    """Where the first `"usage": {...}` key of an event is: (start, object start,
    object end, end), start and end taking in the comma that separates it from a
    neighbouring key, so that cutting [start:end] leaves valid JSON. `at`: where the
    search starts (no `"usage":` before it)."""
    for _ in range(_MAX_TRIES):
        at = event.find(_KEY, at)
        if at < 0:
            return None
        before = at - 1
        while before >= 0 and event[before] in _SPACE:
            before -= 1
        value = at + len(_KEY)
        while event[value : value + 1] in _SPACE_BYTES:
            value += 1
        if before < 0 or event[before] not in b"{," or event[value : value + 1] != b"{":
            at = value
            continue
        close = _object_end(event, value)
        if close < 0:
            return None
        if event[before] == ord(","):
            return before, value, close, close
        after = close
        while event[after : after + 1] in _SPACE_BYTES:
            after += 1
        if event[after : after + 1] == b",":
            after += 1
        return at, value, close, after
    return None


class EventUsage:
    """Reads a chat or completion stream asked with `include_usage` and
    `continuous_usage_stats`: vLLM then writes every chunk's `usage` (the prompt's
    tokens and its choice's completion tokens so far), and a last event of its own,
    `{..., "choices": [], "usage": {...}}`, before `data: [DONE]`
    (vllm/entrypoints/openai/*/serving.py). What the client did not ask for is taken
    out: the last event (`hide_usage`), each chunk's `usage` key (`hide_chunk_usage`,
    cut from the bytes, the rest of the chunk as the engine wrote it). Events are
    relayed up to the last complete one of each chunk; only an event holding the bytes
    `"usage":` (which cannot occur inside a JSON string: its quotes are escaped) is
    looked at. A stream of one prompt and one choice (`single`) is metered its last
    usage, whichever event it came in, parsed once at the end: the chunks in vLLM's
    layout (`usage` their last key, `,"usage":{...}}` closing the event) are cut in one
    pass, their last usage kept as bytes; other events holding the key are parsed whole.
    `events` counts the events relayed, for a stream that reported no usage (a read
    in which a chunk's usage was kept is not counted: the stream is metered by it)."""

    __slots__ = (
        "_choices",
        "_counts",
        "_hide_chunk",
        "_hide_usage",
        "_pending",
        "_pending_at",
        "_rest",
        "_single",
        "_tail",
        "events",
        "last",
    )

    def __init__(
        self, *, hide_usage: bool, hide_chunk_usage: bool, choices: int, single: bool = False
    ) -> None:
        self._rest = b""
        self._hide_usage = hide_usage
        self._hide_chunk = hide_chunk_usage
        # Choices a prompt makes: a completion's choice i belongs to prompt i // n.
        self._choices = max(choices, 1)
        self._single = single
        # The last counts of each choice index.
        self._counts: dict[int, Usage] = {}
        # `single`: the last chunk's usage object, unparsed, less its braces.
        self._pending: bytes | None = None
        # Where in the events being read the kept chunk's were (-1: in none).
        self._pending_at = -1
        # `single`, nothing cut: the last events that held a `"usage":` key.
        self._tail: bytes | None = None
        self.last: Usage | None = None
        self.events = 0

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` (after what was held) goes to the client now."""
        data = self._rest + chunk if self._rest else chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._rest = data
            return b""
        end += _EVENT_END_LEN
        if end == len(data):
            self._rest = b""
            ready = data
        else:
            self._rest = data[end:]
            ready = data[:end]
        if not self._single:
            self.events += ready.count(_EVENT_END)
            return self._scan(ready)
        if not self._hide_chunk:
            # Nothing to cut (`hide_usage` comes with `hide_chunk`): the stream's last
            # usage, the final event's or its last chunk's, is its count.
            self.events += ready.count(_EVENT_END)
            if _KEY in ready:
                self._tail = ready
            return ready
        # The chunks in vLLM's layout, in one pass: their usage cut, the last one kept.
        pieces = ready.split(_CHUNK_KEY)
        if len(pieces) == 1:
            self._pending_at = -1
            self.events += ready.count(_EVENT_END)
            return self._scan(ready)
        if len(pieces) == 2:
            # One chunk (an engine streaming token by token sends one a read).
            usage, _, rest = pieces[1].partition(b"}")
            if rest.startswith(_CHUNK_END):
                self._pending = usage
                self._pending_at = len(pieces[0]) + len(_CHOICES_END)
                return self._scan(pieces[0] + _CHOICES_END + rest)
        # Each piece after the first: the usage object less its braces, `}`, the rest.
        # A slice compared, not `startswith`: its argument parsing costs ~1K instructions
        # a chunk (callgrind).
        parts = [piece.partition(b"}") for piece in pieces[1:]]
        closing, width = _CHUNK_END, _CHUNK_END_LEN
        kept = [r if r[:width] == closing else _USAGE_KEY + u + c + r for u, c, r in parts]
        cut = _CHOICES_END.join([pieces[0], *kept])
        # The last chunk cut: its usage kept, and where it was in `cut`.
        after = 0
        for (usage, _, rest), piece in zip(reversed(parts), reversed(kept), strict=True):
            if piece is rest:
                self._pending = usage
                self._pending_at = len(cut) - after - len(piece)
                # What is left to read: events in another layout, the usage event.
                return self._scan(cut)
            after += len(piece) + len(_CHOICES_END)
        # No chunk's usage: its events count for a stream cut before any usage.
        self._pending_at = -1
        self.events += ready.count(_EVENT_END)
        return self._scan(ready)

    def _scan(self, ready: bytes) -> bytes:
        """`ready` (whole events) less what the client did not ask for, each event
        holding a `"usage":` key read."""
        at = ready.find(_KEY)
        if at < 0:
            return ready
        # Only the events holding the key are looked at, in place: what goes out is
        # `ready` less the cuts, joined once. Events are `ready` less its last blank
        # line, split at each blank line.
        last = len(ready) - _EVENT_END_LEN
        kept: list[bytes] = []
        pos = 0  # `ready[:pos]` is decided (in `kept`, or cut)
        event = 0  # where the event looked at starts
        while at >= 0:
            before = ready.rfind(_EVENT_END, event, at)
            if before >= 0:
                event = before + _EVENT_END_LEN
            stop = ready.find(_EVENT_END, at, last)
            if stop < 0:
                stop = last
            cut = self._cut(ready, event, stop, at)
            if cut is not None:
                kept.append(ready[pos : cut[0]])
                pos = cut[1]
            event = stop + _EVENT_END_LEN
            at = ready.find(_KEY, event)
        if not pos:
            return ready
        kept.append(ready[pos:])
        return b"".join(kept)

    def _cut(self, ready: bytes, start: int, stop: int, at: int) -> tuple[int, int] | None:
        """The event `ready[start:stop]`, whose first `"usage":` is at `at`, read: what
        of `ready` to cut from what the client gets (the whole event with its blank
        line, or its usage key), None for nothing."""
        value = at + _KEY_LEN
        if (
            ready[at - 1] == _COMMA
            and ready[value] == _OPEN
            and ready.startswith(_DATA, start)
            and at - 1 > start
        ):
            # vLLM's layout, `,"usage":{` with no space: read in place.
            # `_object_end`, inlined, within the event.
            pos = value
            depth = 0
            while True:
                close = ready.find(b"}", pos, stop)
                if close < 0:
                    return None
                depth += ready.count(b"{", pos, close) - 1
                if depth <= 0:
                    break
                pos = close + 1
            close += 1
            first, last = at - 1, close
        else:
            event = ready[start:stop]
            if not event.startswith(_DATA):
                return None
            span = _usage_span(event, at - start)
            if span is None:
                return None
            first, value, close, last = (i + start for i in span)
        try:
            data = orjson.loads(ready[start + _DATA_LEN : stop])
            usage = orjson.loads(ready[value:close])
        except orjson.JSONDecodeError:
            return None
        if type(data) is not dict or data.get("usage") != usage:
            # Not the top-level key: relayed as it is.
            return None
        counts = usage_of(usage)
        if counts is None:
            return None
        choices = data.get("choices")
        if choices == []:
            self.last = counts
            if self._hide_usage:
                self.events -= 1
                return start, stop + _EVENT_END_LEN
            return None
        if type(choices) is list:
            if start > self._pending_at:
                # Newer than the chunk kept unparsed.
                self._pending = None
            for choice in choices:
                index = choice.get("index") if type(choice) is dict else None
                if type(index) is int and index >= 0:
                    self._counts[index] = counts
        return (first, last) if self._hide_chunk else None

    def usage(self) -> Usage | None:
        """The stream's usage: its last event's, or else (a stream cut short) its
        chunks' last counts: each prompt's tokens once, each choice's completion."""
        if self._tail is not None:
            return read_usage(self._tail)
        if self.last is not None:
            return self.last
        if self._pending is not None:
            try:
                return usage_of(orjson.loads(b"{" + self._pending + b"}"))
            except orjson.JSONDecodeError:
                return None
        if not self._counts:
            return None
        prompts: dict[int, int] = {}
        completion = 0
        for index, (prompt, done) in self._counts.items():
            group = index // self._choices
            prompts[group] = max(prompts.get(group, 0), prompt)
            completion += done
        return sum(prompts.values()), completion

    def flush(self) -> bytes:
        """What was held at the end of the stream (an event without its blank line)."""
        rest, self._rest = self._rest, b""
        return rest


# What vLLM 0.32 names the events of a /v1/messages stream (`message_stream_converter` in
# vllm/entrypoints/anthropic/serving.py) and of a /v1/responses stream
# (`responses_stream_generator` in vllm/entrypoints/openai/responses/serving.py); the two
# sets share no name.
# The first event: its usage is the first chunk's, the whole prompt in `input_tokens`.
_START = b"message_start"
# An Anthropic block's output, and every Responses `*.delta` event (text, reasoning,
# tool arguments): each carries what one engine output added.
_BLOCK_DELTA = b"content_block_delta"
_DELTA_SUFFIX = b".delta"
# The thinking block's closing `content_block_delta`: its signature, no output. `":"`
# cannot occur inside a JSON string (its quotes are escaped), so these bytes are a key
# and its value.
_SIGNATURE = b'"type":"signature_delta"'
# The events that carry the final usage.
_FINAL = frozenset({b"message_delta", b"response.completed"})


class Steps:
    """What a /v1/messages or /v1/responses stream reported before its final usage, for
    a stream that ends without it (the client left, the engine broke or sent an `error`
    event): the prompt's count of `message_start` (/v1/messages; a Responses stream
    reports none before `response.completed`) and one completion token an output event
    (`*_delta` and `*.delta`, a thinking block's signature aside). vLLM sends an event an
    engine output, and an output holds one token or, when the server lags, several: the
    count is at most what was generated. Only the first `TAIL` bytes of each event are
    kept (a `response.created` echoes the request's `instructions`)."""

    __slots__ = ("_ended", "_head", "_newline", "_outputs", "_prompt")

    def __init__(self) -> None:
        # The first bytes of the event under way.
        self._head = b""
        # The event under way has bytes and its last one is a newline: a chunk opening
        # with a newline ends it.
        self._newline = False
        self._prompt: int | None = None
        self._outputs = 0
        self._ended = False

    def _keep(self, chunk: bytes, start: int, end: int) -> bytes:
        """The head of the event under way with `chunk[start:end]` added, up to `TAIL`
        bytes."""
        head = self._head
        self._head = b""
        room = TAIL - len(head)
        if room <= 0:
            return head
        return head + chunk[start : min(end, start + room)]

    def add(self, chunk: bytes) -> None:
        start = 0
        if self._newline and chunk[:1] == b"\n":
            self._event(self._keep(chunk, 0, 0))
            start = 1
        while (end := chunk.find(_EVENT_END, start)) >= 0:
            self._event(self._keep(chunk, start, end))
            start = end + len(_EVENT_END)
        self._newline = start < len(chunk) and chunk.endswith(b"\n")
        if start < len(chunk):
            self._head = self._keep(chunk, start, len(chunk))

    def _event(self, head: bytes) -> None:
        if not head.startswith(_EVENT):
            return
        line = head.find(b"\n")
        name = head[len(_EVENT) : line if line >= 0 else len(head)]
        if name == _BLOCK_DELTA:
            if _SIGNATURE not in head:
                self._outputs += 1
        elif name.endswith(_DELTA_SUFFIX):
            self._outputs += 1
        elif name == _START:
            counts = read_usage(head)
            if counts is not None:
                self._prompt = counts[0]
        elif name in _FINAL:
            self._ended = True

    def usage(self, reported: Usage | None) -> Usage | None:
        """The stream's usage: `reported` (the last usage object of its bytes: `Tail`)
        once its final event came whole; else what the events before it reported."""
        if self._ended and reported is not None:
            return reported
        if self._prompt is None and not self._outputs:
            return None
        return self._prompt or 0, self._outputs
