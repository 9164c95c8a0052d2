"""gateway/proxy/usage.py as tables: the tokens read from the end of an engine's answer, and
from the last chunks of a stream however it was cut. The same through a running
gateway and simulated engine: tests/e2e/test_usage.py."""

from __future__ import annotations

import orjson
import pytest

from gateway.exchange import Usage
from gateway.proxy.usage import (
    TAIL,
    EventUsage,
    Steps,
    Tail,
    audio_seconds,
    parse_usage,
    read_usage,
    usage_of,
)

USAGE = {
    "prompt_tokens": 17,
    "total_tokens": 25,
    "completion_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 16},
    "completion_tokens_details": None,
}


def chat_answer(content: str = "hello", **extra: object) -> bytes:
    """A non-streamed chat answer in vLLM 0.32's field order (usage near the end)."""
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": USAGE,
            "prompt_logprobs": None,
            **extra,
        }
    )


def sse(*events: dict[str, object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def delta(text: str) -> dict[str, object]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }


STREAM = sse(
    delta("a"), delta("b"), {"object": "chat.completion.chunk", "choices": [], "usage": USAGE}
)

CASES: list[tuple[str, bytes, Usage | None]] = [
    ("chat answer", chat_answer(), (17, 8)),
    ("stream with include_usage", STREAM, (17, 8)),
    ("stream without usage", sse(delta("a"), delta("b")), None),
    # Text quoting a usage object is inside a string: its quotes are escaped.
    ("usage quoted in the content", chat_answer('"usage": {"prompt_tokens": 999}'), (17, 8)),
    (
        "quoted usage in a string after the real one",
        chat_answer(prompt_text='x"usage":{"prompt_tokens":999,"completion_tokens":9}'),
        (17, 8),
    ),
    # Completions' top_logprobs are objects keyed by token text, which a client steers.
    (
        "a token key ending in usage",
        orjson.dumps({"choices": [{"logprobs": {"top_logprobs": [{'"usage': -0.1}]}}]}),
        None,
    ),
    ("a token key usage with a number", orjson.dumps({"top": [{"usage": -0.1}]}), None),
    ("usage null", orjson.dumps({"choices": [], "usage": None}), None),
    ("usage not an object", orjson.dumps({"usage": "many"}), None),
    ("no usage", orjson.dumps({"status": "ok"}), None),
    ("empty", b"", None),
    ("cut inside the usage", chat_answer()[: chat_answer().index(b"completion_tokens")], None),
    ("usage without counts", orjson.dumps({"usage": {"total_tokens": 5}}), None),
    ("negative count", orjson.dumps({"usage": {"prompt_tokens": -5}}), None),
    ("boolean count", orjson.dumps({"usage": {"prompt_tokens": True}}), None),
    ("counts not numbers", orjson.dumps({"usage": {"prompt_tokens": "5"}}), None),
    ("malformed object", b'{"usage":{"prompt_tokens":5,,}}', None),
    # Pooling answers report prompt tokens only.
    (
        "embeddings",
        orjson.dumps({"data": [], "usage": {"prompt_tokens": 12, "total_tokens": 12}}),
        (12, 0),
    ),
    # The Responses and Messages APIs name them input and output tokens.
    (
        "responses",
        orjson.dumps(
            {"output": [], "usage": {"input_tokens": 9, "output_tokens": 4}, "user": None}
        ),
        (9, 4),
    ),
    # Cohere's chat API (vLLM 0.32): counts as floats in an answer, as ints in the
    # stream's message-end event; `billed_units` repeats them.
    (
        "cohere chat answer",
        orjson.dumps(
            {
                "id": "c",
                "finish_reason": "COMPLETE",
                "message": {"role": "assistant", "content": []},
                "usage": {
                    "billed_units": {"input_tokens": 32.0, "output_tokens": 5.0},
                    "tokens": {"input_tokens": 32.0, "output_tokens": 5.0},
                    "cached_tokens": 0.0,
                },
            }
        ),
        (32, 5),
    ),
    (
        "cohere chat stream's end",
        b'data: {"type":"message-end","id":"c","delta":{"finish_reason":"COMPLETE","usage":'
        b'{"billed_units":{"input_tokens":7,"output_tokens":2},'
        b'"tokens":{"input_tokens":7,"output_tokens":2}}}}\n\n',
        (7, 2),
    ),
    ("a count with a fraction", orjson.dumps({"usage": {"prompt_tokens": 2.5}}), None),
    (
        "cohere tokens not an object",
        orjson.dumps({"usage": {"tokens": 5, "prompt_tokens": 3}}),
        (3, 0),
    ),
    (
        "spaces (json.dumps)",
        b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}',
        (3, 2),
    ),
    (
        "completion tokens null",
        orjson.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": None}}),
        (3, 0),
    ),
    (
        "the last of several (continuous usage stats)",
        sse(
            {"usage": {"prompt_tokens": 3, "completion_tokens": 1}},
            {"usage": {"prompt_tokens": 3, "completion_tokens": 2}},
        ),
        (3, 2),
    ),
]


@pytest.mark.parametrize(("data", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_read_usage(data: bytes, expected: Usage | None) -> None:
    assert read_usage(data) == expected


def test_a_usage_far_from_the_end_is_found() -> None:
    # What follows `usage` is the client's to lengthen: the rendered prompt, prompt
    # logprobs, a Responses answer's `user`. Searching only the last TAIL bytes missed it.
    body = chat_answer(prompt_text="x" * (TAIL + 100))
    assert read_usage(body) == (17, 8)
    assert len(body) - body.rindex(b'"usage":') > TAIL


def responses_stream(user: str) -> bytes:
    """A Responses stream in vLLM 0.32's order: `response.completed` carries the whole
    response, whose `usage` is followed by the request's `user`."""
    events = [
        {"type": "response.created", "response": {"id": "r", "usage": None, "user": user}},
        *({"type": "response.output_text.delta", "delta": "x" * 40} for _ in range(100)),
        {
            "type": "response.completed",
            "response": {
                "id": "r",
                "output": [],
                "usage": {"input_tokens": 9, "output_tokens": 4},
                "user": user,
                "input_messages": None,
            },
        },
    ]
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"  # type: ignore[attr-defined]
        for e in events
    )


@pytest.mark.parametrize("size", [1, 7, 300, TAIL - 1, TAIL, TAIL + 1, 3 * TAIL, 10**6])
@pytest.mark.parametrize("user", ["", "u" * (3 * TAIL)])
def test_tail_finds_a_usage_followed_by_more_than_its_size(size: int, user: str) -> None:
    stream = responses_stream(user)
    tail = Tail()
    for i in range(0, len(stream), size):
        tail.add(stream[i : i + size])
    assert tail.usage() == (9, 4)


@pytest.mark.parametrize("size", [1, 7, 64, 300, TAIL - 1, TAIL, TAIL + 1, 3 * TAIL])
def test_tail_reads_a_stream_however_it_was_cut(size: int) -> None:
    head = sse(*(delta("x" * 50) for _ in range(200)))[: -len(b"data: [DONE]\n\n")]
    stream = head + STREAM
    tail = Tail()
    for i in range(0, len(stream), size):
        tail.add(stream[i : i + size])
    assert tail.usage() == (17, 8)


def test_tail_of_a_stream_without_usage_or_empty() -> None:
    tail = Tail()
    assert tail.usage() is None
    for _ in range(100):
        tail.add(orjson.dumps(delta("y" * 100)))
    assert tail.usage() is None


def test_tail_keeps_a_bounded_number_of_bytes() -> None:
    tail = Tail()
    for _ in range(10_000):
        tail.add(b"z" * 97)
    assert TAIL <= sum(len(c) for c in tail._chunks) <= 2 * TAIL


USAGE_OBJECTS = [
    # OpenAI shapes, pooling (no completion), Responses and /v1/systemone.
    (USAGE, (17, 8)),
    ({"prompt_tokens": 5, "total_tokens": 5}, (5, 0)),
    ({"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}, (9, 2)),
    # Anthropic: the prompt is split in three (vllm/entrypoints/anthropic/serving.py).
    ({"input_tokens": 19, "output_tokens": 4, "cache_read_input_tokens": 896}, (915, 4)),
    ({"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 8,
      "cache_creation_input_tokens": 16}, (27, 1)),
    ({"input_tokens": 3, "output_tokens": 1, "cache_creation_input_tokens": None}, (3, 1)),
    # Cohere's chat API.
    ({"billed_units": {}, "tokens": {"input_tokens": 12.0, "output_tokens": 3.0}}, (12, 3)),
    # Not a usage.
    ({"label_mass": 0.9, "argmax_is_label": True}, None),
    ({"prompt_tokens": -1}, None),
    ([1, 2], None),
    (None, None),
]  # fmt: skip


@pytest.mark.parametrize(("usage", "expected"), USAGE_OBJECTS)
def test_usage_of(usage: object, expected: Usage | None) -> None:
    assert usage_of(usage) == expected


def test_a_whole_answer_is_parsed_for_its_top_level_usage() -> None:
    # /v1/systemone: a question named `usage` comes after the answer's own usage.
    answer = orjson.dumps(
        {
            "answers": {"usage": {"type": "noul"}},
            "usage": {"input_tokens": 40, "output_tokens": 2},
            "diagnostics": {"usage": {"label_mass": 0.9, "argmax_is_label": True}},
        }
    )
    assert parse_usage(answer) == (40, 2)
    assert parse_usage(b"plain text") is None
    assert parse_usage(b"[1]") is None


AUDIO = [
    ({"text": "hi", "usage": {"type": "duration", "seconds": 3}}, 3.0),
    ({"text": "hi", "duration": 2.5, "segments": []}, 2.5),
    ({"text": "hi"}, None),
    ({"text": "hi", "usage": {"type": "tokens", "input_tokens": 5}}, None),
    ({"duration": -1}, None),
    ({"duration": "3"}, None),
]


@pytest.mark.parametrize(("answer", "expected"), AUDIO)
def test_audio_seconds(answer: dict[str, object], expected: float | None) -> None:
    assert audio_seconds(orjson.dumps(answer)) == expected


def cut(stream: bytes, size: int, reader: EventUsage) -> bytes:
    out = b"".join(reader.feed(stream[i : i + size]) for i in range(0, len(stream), size))
    return out + reader.flush()


def counted(index: int, prompt: int, completion: int, **extra: object) -> dict[str, object]:
    """A chunk asked with `continuous_usage_stats`, as vLLM 0.32 writes it (usage after
    choices)."""
    usage = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "completion_tokens_details": None,
    }
    choice = {"index": index, "delta": {"content": '"usage": {}'}}
    return {"id": "c", "model": "m", "choices": [choice], "usage": usage, **extra}


def bare(event: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in event.items() if k != "usage"}


def test_event_usage_takes_the_usage_event_out_however_the_stream_is_cut() -> None:
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": '"usage": {}'}}]}
    final = {"id": "c", "choices": [], "usage": USAGE}
    stream = sse(chunk, chunk, final)
    expected = sse(chunk, chunk)
    for size in (1, 7, 64, len(stream)):
        reader = EventUsage(hide_usage=True, hide_chunk_usage=True, choices=1)
        assert cut(stream, size, reader) == expected, size
        assert reader.usage() == (17, 8)
        assert reader.events == 3


@pytest.mark.parametrize("single", [False, True])
def test_event_usage_takes_each_chunks_usage_out_byte_for_byte(single: bool) -> None:
    chunks = [counted(0, 17, 0), counted(0, 17, 1), counted(0, 17, 2, system_fingerprint="f")]
    final = {"id": "c", "choices": [], "usage": USAGE}
    stream = sse(*chunks, final)
    for size in (1, 5, 300, len(stream)):
        # The client asked for neither: the chunks as they are without the option.
        reader = EventUsage(hide_usage=True, hide_chunk_usage=True, choices=1, single=single)
        assert cut(stream, size, reader) == sse(*map(bare, chunks)), size
        assert reader.usage() == (17, 8)
        # It asked for the usage event only.
        reader = EventUsage(hide_usage=False, hide_chunk_usage=True, choices=1, single=single)
        assert cut(stream, size, reader) == sse(*map(bare, chunks), final), size
        # It asked for both.
        reader = EventUsage(hide_usage=False, hide_chunk_usage=False, choices=1, single=single)
        assert cut(stream, size, reader) == stream, size


def chunk_bytes(prompt: int, completion: int, *, details: bool = False) -> bytes:
    """A chat chunk with its counts as vLLM 0.32 writes it (compact, `usage` last)."""
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
    usage["completion_tokens"] = completion
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": 16}  # type: ignore[assignment]
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    choice = {"index": 0, "delta": {"content": '"usage":{'}, "logprobs": None}
    return b"data: " + orjson.dumps({**head, "choices": [choice], "usage": usage}) + b"\n\n"


@pytest.mark.parametrize("size", [1, 9, 40, 10_000])
def test_a_single_choice_stream_cut_short_is_metered_its_last_chunk(size: int) -> None:
    # Chunks in vLLM's layout are kept unparsed; one with nested counts, read whole, and
    # one in the layout after it: the last one's counts are the stream's.
    stream = chunk_bytes(17, 1) + chunk_bytes(17, 2, details=True) + chunk_bytes(17, 3)
    for chunks, expected in ((stream, (17, 3)), (stream[: stream.rfind(b"data:")], (17, 2))):
        reader = EventUsage(hide_usage=True, hide_chunk_usage=True, choices=1, single=True)
        out = cut(chunks, size, reader)
        assert b'"usage":{' not in out.replace(b'\\"usage\\":{', b"")
        assert [orjson.loads(e[6:])["choices"] for e in out.split(b"\n\n")[:-1]] == [
            orjson.loads(e[6:])["choices"] for e in chunks.split(b"\n\n")[:-1]
        ]
        assert reader.usage() == expected


def test_a_single_choice_stream_without_chunk_counts_counts_its_events() -> None:
    # No chunk carries its counts (an engine that ignored the option): the events
    # relayed are what a stream cut short is metered by (relay.py, `_left_early`).
    stream = b"".join(
        chunk_bytes(17, i)[: -len(b"}\n\n")].rsplit(b',"usage"', 1)[0] + b"}\n\n" for i in (1, 2, 3)
    )
    for size in (1, 9, 10_000):
        reader = EventUsage(hide_usage=True, hide_chunk_usage=True, choices=1, single=True)
        assert cut(stream, size, reader) == stream
        assert reader.usage() is None
        assert reader.events == 3


def test_a_usage_key_first_in_its_event_is_cut_with_its_comma() -> None:
    usage = b'{"prompt_tokens": 3, "completion_tokens": 1}'
    event = b'data: {"usage": ' + usage + b', "choices": [{"index": 0}]}\n\n'
    reader = EventUsage(hide_usage=True, hide_chunk_usage=True, choices=1)
    out = reader.feed(event)
    assert orjson.loads(out[len(b"data: ") :]) == {"choices": [{"index": 0}]}
    assert reader.usage() == (3, 1)


@pytest.mark.parametrize(
    ("chunks", "choices", "expected"),
    [
        # One choice: its last counts.
        ([counted(0, 17, 0), counted(0, 17, 1), counted(0, 17, 2)], 1, (17, 2)),
        # n = 2 of one prompt: the prompt once, both choices' completions.
        ([counted(0, 17, 0), counted(1, 17, 0), counted(0, 17, 3), counted(1, 17, 1)], 2, (17, 4)),
        # Two prompts (a completion's choice i belongs to prompt i // n).
        ([counted(0, 5, 2), counted(1, 9, 1)], 1, (14, 3)),
        ([counted(0, 5, 2), counted(1, 5, 1), counted(2, 9, 4)], 2, (14, 7)),
    ],
)
def test_a_stream_cut_short_is_metered_its_last_counts(
    chunks: list[dict[str, object]], choices: int, expected: Usage
) -> None:
    reader = EventUsage(hide_usage=True, hide_chunk_usage=True, choices=choices)
    stream = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    out = reader.feed(stream)
    assert b'"usage"' not in out.replace(b'\\"usage\\"', b"")
    assert reader.usage() == expected


def test_event_usage_keeps_every_other_event() -> None:
    # A `usage` key inside a nested object is not the chunk's: relayed as it is.
    nested = {"id": "c", "choices": [{"index": 0, "x": {"usage": USAGE}}]}
    stream = sse(nested) + b"data: {not json\n\n"
    reader = EventUsage(hide_usage=True, hide_chunk_usage=True, choices=1)
    assert reader.feed(stream) + reader.flush() == stream
    assert reader.usage() is None


def named(name: str, data: dict[str, object]) -> bytes:
    """An event as vLLM 0.32 writes /v1/messages and /v1/responses events."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def block_delta(delta: dict[str, object]) -> bytes:
    return named("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": 0})


# A /v1/messages stream as the real engine sent it (tiny-qwen3, max_tokens 5,
# --enable-prompt-tokens-details), with a thinking block's signature added.
_START_MESSAGE = {
    "id": "chatcmpl-a",
    "type": "message",
    "role": "assistant",
    "content": [],
    "model": "tiny-qwen3",
    "stop_reason": None,
    "stop_sequence": None,
    "usage": {"input_tokens": 37, "output_tokens": 0},
}
MESSAGES = [
    named("message_start", {"type": "message_start", "message": _START_MESSAGE}),
    named(
        "content_block_start",
        {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
    ),
    *(block_delta({"type": "text_delta", "text": t}) for t in ("ant", " 437", ' "usage":{', "x")),
    block_delta({"type": "signature_delta", "signature": "abc"}),
    block_delta({"type": "input_json_delta", "partial_json": '{"type":"signature_delta"'}),
    named("content_block_stop", {"type": "content_block_stop", "index": 0}),
    named(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {
                "input_tokens": 5,
                "output_tokens": 5,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 32,
            },
        },
    ),
    named("message_stop", {"type": "message_stop"}),
]


def responses_events(instructions: str) -> list[bytes]:
    """A /v1/responses stream in the real engine's shape, the request's `instructions`
    echoed in its first and last events."""
    started = {"id": "resp_a", "instructions": instructions, "status": "in_progress", "usage": None}
    item = {"content_index": 0, "item_id": "msg_a", "output_index": 0}
    usage = {"input_tokens": 37, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5}
    done = {**started, "status": "completed", "usage": usage, "user": None}
    return [
        named("response.created", {"response": started, "type": "response.created"}),
        named("response.in_progress", {"response": started, "type": "response.in_progress"}),
        named("response.content_part.added", {**item, "type": "response.content_part.added"}),
        *(
            named(name, {**item, "delta": "d", "type": name})
            for name in (
                "response.output_text.delta",
                "response.reasoning_text.delta",
                "response.function_call_arguments.delta",
            )
        ),
        named("response.output_text.done", {**item, "text": "ddd", "type": "x"}),
        named("response.completed", {"response": done, "type": "response.completed"}),
    ]


def steps_of(events: list[bytes], size: int) -> tuple[Steps, Usage | None]:
    """The stream's events fed in chunks of `size` bytes, and its `Tail`'s usage."""
    stream = b"".join(events)
    steps, tail = Steps(), Tail()
    for at in range(0, len(stream), size):
        steps.add(stream[at : at + size])
        tail.add(stream[at : at + size])
    return steps, tail.usage()


@pytest.mark.parametrize("size", [1, 2, 7, 64, TAIL + 1, 10**6])
@pytest.mark.parametrize(
    ("events", "whole", "cut"),
    [
        # The prompt: all of `message_start`'s (Anthropic's split at the end: 5 + 32);
        # 5 outputs, the thinking block's signature aside.
        (MESSAGES, (37, 5), [None, (37, 0), (37, 0), (37, 1), (37, 2), (37, 3), (37, 4),
                             (37, 4), (37, 5), (37, 5), (37, 5), (37, 5)]),
        # No count before `response.completed`: the outputs alone.
        (responses_events("i"), (37, 5), [None, None, None, None, (0, 1), (0, 2), (0, 3),
                                          (0, 3)]),
        (responses_events("i" * 3 * TAIL), (37, 5), None),
    ],
)  # fmt: skip
def test_steps_meter_a_stream_cut_before_its_usage(
    events: list[bytes], whole: Usage, cut: list[Usage | None] | None, size: int
) -> None:
    steps, tail = steps_of(events, size)
    assert steps.usage(tail) == whole
    for end, expected in enumerate(cut or []):
        steps, tail = steps_of(events[:end], size)
        assert steps.usage(tail) == expected, end
    # Cut inside the final event: what came before it.
    steps, tail = steps_of([*events[:-1], events[-1][:-1]], size)
    assert steps.usage(tail) == steps_of(events[:-1], size)[0].usage(None)
