"""Token counts from an engine's answer: its `usage` object, found by its key.

vLLM puts `usage` near the end of a non-streamed answer, and a stream asked for with
`stream_options.include_usage` sends it in its last data event, before `data: [DONE]`.
What follows it can still be long, and the client decides how long: the rendered prompt
(`return_prompt_text`), `prompt_logprobs` and `prompt_token_ids` in a chat answer, the
request's `user` and, when asked for, the raw messages in a Responses answer and in its
stream's `response.completed` event, the per-question diagnostics of /v1/systemone.
So a non-streamed answer (held whole, up to 64 KiB: proxy/relay.py) is searched from its end
for the last `"usage":` key, and a stream's bytes are searched as they are dropped from
the tail it keeps (`Tail`); only the `usage` object itself is parsed. The search is
`bytes.rfind` (memchr speed), so its cost grows with the answer only by that: 2.3-2.9
us for a 750-byte chat answer and for a 15 KB one were measured with the tail alone,
where orjson parsing the whole answer took 2.5 us and 7.4 us. Answers that report no
usage (a stream without `include_usage`, one cut off, a refusal) count no tokens.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.exchange import Usage

# Bytes at the end of an answer searched for its `usage`: the usage event of a stream
# (about 300 bytes) and what follows it, with room to spare.
TAIL = 4096
_KEY = b'"usage":'
_SPACE = b" \t\r\n"
_SPACE_BYTES = (b" ", b"\t", b"\r", b"\n")
# Occurrences of `"usage":` tried from the end (one inside a string, or not followed by
# an object, is skipped).
_MAX_TRIES = 4


def _count(value: Any) -> int | None:
    if type(value) is float and value.is_integer():
        # Cohere's chat answers type their counts as floats (`32.0`).
        value = int(value)
    return value if type(value) is int and value >= 0 else None


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
    """The tokens of the last `"usage": {...}` in `data`: prompt tokens
    (`prompt_tokens`, or the Responses and Messages APIs' `input_tokens`) and completion
    tokens (`completion_tokens` or `output_tokens`, 0 when absent: pooling answers); for
    Cohere's chat API, those of its `tokens` object. None when there is none, or it
    cannot be read."""
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
        get = usage.get
        if "tokens" in usage and type(usage["tokens"]) is dict:
            # Cohere's chat API: {"tokens": {"input_tokens", "output_tokens"}, "billed_units"}.
            get = usage["tokens"].get
        prompt = _count(get("prompt_tokens", get("input_tokens")))
        completion = _count(get("completion_tokens", get("output_tokens")))
        if prompt is None and completion is None:
            return None
        return prompt or 0, completion or 0
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
