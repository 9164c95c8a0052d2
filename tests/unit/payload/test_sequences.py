"""gateway/payload/sequences.py as a table: the engine sequences each body shape makes
vLLM 0.32 run (read from its source: the shapes are named in the module), and counts
the gateway cannot read refused. Through real processes: tests/e2e/test_sequences.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.payload.sequences import WEIGHERS, sequences, speech

MSG = [{"role": "user", "content": "hi"}]
TOKENS = [1, 2, 3]


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        # Chat: n samples, or n beams.
        ("/v1/chat/completions", {"messages": MSG}, (1, None)),
        ("/v1/chat/completions", {"messages": MSG, "n": 64}, (64, "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": 4, "use_beam_search": True}, (4, "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": None}, (1, None)),
        # Numbers as vLLM's pydantic reads them, rounded up where it would refuse.
        ("/v1/chat/completions", {"messages": MSG, "n": "64"}, (64, "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": " 6_4 "}, (64, "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": "+64"}, (64, "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": 64.0}, (64, "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": "63.5"}, (64, "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": 1e30}, (int(1e30), "n")),
        ("/v1/chat/completions", {"messages": MSG, "n": True}, (1, None)),
        ("/v1/chat/completions", {"messages": MSG, "n": -5}, (1, None)),
        # best_of: ignored by vLLM 0.32, run by older engines; the larger counts.
        ("/v1/chat/completions", {"messages": MSG, "n": 2, "best_of": 8}, (8, "best_of")),
        ("/v1/chat/completions", {"messages": MSG, "n": 8, "best_of": 2}, (8, "n")),
        # Batch chat: one sequence per conversation (x n, which vLLM refuses above 1).
        ("/v1/chat/completions/batch", {"messages": [MSG] * 3000}, (3000, "messages")),
        ("/v1/chat/completions/batch", {"messages": [MSG, MSG], "n": 3}, (6, "n")),
        ("/v1/chat/completions/batch", {"messages": [MSG] * 3, "n": 2}, (6, "messages")),
        ("/v1/chat/completions/batch", {"messages": [MSG], "n": 3}, (3, "n")),
        ("/v1/chat/completions/batch", {"messages": MSG}, (1, None)),
        # Completions: every prompt of a list, times n; prompt_embeds too.
        ("/v1/completions", {"prompt": "hi"}, (1, None)),
        ("/v1/completions", {"prompt": TOKENS}, (1, None)),
        ("/v1/completions", {"prompt": ["a"] * 256}, (256, "prompt")),
        ("/v1/completions", {"prompt": [TOKENS] * 5}, (5, "prompt")),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 16}, (32, "n")),
        ("/v1/completions", {"prompt": "hi", "n": 5, "use_beam_search": True}, (5, "n")),
        ("/v1/completions", {"prompt": "hi", "prompt_embeds": ["e1", "e2"]}, (3, "prompt")),
        ("/v1/completions", {"prompt": []}, (1, None)),
        # A list read as token ids by its first item only, another item a prompt.
        ("/v1/completions", {"prompt": [1, "a", "b"]}, (3, "prompt")),
        # Pooling: prompts of `input`, or conversations.
        ("/v1/embeddings", {"input": "hi"}, (1, None)),
        ("/v1/embeddings", {"input": TOKENS}, (1, None)),
        ("/v1/embeddings", {"input": ["a", "b", "c"]}, (3, "input")),
        ("/v1/embeddings", {"input": [TOKENS] * 4}, (4, "input")),
        ("/v1/embeddings", {"input": MSG}, (1, None)),
        ("/v1/embeddings", {"input": [MSG] * 7}, (7, "input")),
        ("/v1/embeddings", {"messages": MSG}, (1, None)),
        ("/v1/embeddings", {"messages": [MSG] * 9}, (9, "messages")),
        ("/pooling", {"input": ["a"] * 10}, (10, "input")),
        ("/classify", {"input": ["a"] * 11}, (11, "input")),
        ("/v2/embed", {"texts": ["a", "b"], "images": ["x"]}, (3, "texts")),
        ("/v2/embed", {"inputs": [{"content": []}] * 5}, (5, "texts")),
        # Scoring: both sides (a bi-encoder embeds each); rerank: the query and each document.
        ("/score", {"text_1": "q", "text_2": ["a", "b", "c"]}, (4, "text_2")),
        ("/v1/score", {"queries": ["q1", "q2"], "documents": ["a", "b"]}, (4, "documents")),
        ("/v1/score", {"queries": "q", "items": ["a"] * 5}, (6, "items")),
        ("/v1/score", {"data_1": ["q"] * 3, "data_2": ["a"] * 3}, (6, "data_2")),
        ("/rerank", {"query": "q", "documents": ["a"] * 99}, (100, "documents")),
        ("/v1/rerank", {"query": "q", "documents": "a"}, (2, "documents")),
        ("/v2/rerank", {"query": "q", "documents": ["a"] * 3}, (4, "documents")),
        ("/generative_scoring", {"query": "q", "items": ["a"] * 8}, (8, "items")),
        (
            "/v1/systemone",
            {"state": "s", "questions": {f"q{i}": {} for i in range(5)}},
            (5, "questions"),
        ),
        # SageMaker: the heaviest of the request types it may be taken for.
        ("/invocations", {"messages": MSG, "n": 12}, (12, "n")),
        ("/invocations", {"prompt": ["a"] * 20}, (20, "prompt")),
        ("/invocations", {"input": ["a"] * 30, "messages": MSG}, (30, "input")),
        ("/invocations", {"query": "q", "documents": ["a"] * 40}, (41, "documents")),
        # One sequence: a single conversation, whatever else the body holds.
        ("/v1/messages", {"messages": MSG, "n": 50}, (1, None)),
        ("/v1/responses", {"input": ["a"] * 50}, (1, None)),
        ("/cohere/v2/chat", {"messages": MSG, "documents": ["a"] * 50}, (1, None)),
        ("/tokenize", {"prompt": ["a"] * 50}, (1, None)),
    ],
)
def test_weight_of_each_shape(path: str, body: dict[str, Any], expected: tuple[int, Any]) -> None:
    assert sequences(path, body) == expected


def test_a_body_that_is_not_json_is_one_sequence() -> None:
    assert sequences("/v1/completions", None) == (1, None)


@pytest.mark.parametrize("value", ["many", "0x40", "1e2x", "", "nan", "inf", [64], {"n": 64}])
@pytest.mark.parametrize("name", ["n", "best_of"])
def test_a_count_that_cannot_be_read_is_refused(name: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        sequences("/v1/completions", {"prompt": "hi", name: value})
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_request", name)


def test_every_weighed_route_is_in_the_endpoint_table() -> None:
    from gateway.access.endpoints import TABLE

    assert set(WEIGHERS) <= set(TABLE)


def _form(**values: str) -> dict[str, list[str]]:
    return {name: [value] for name, value in values.items()}


SPEECH = [
    # (form fields, seconds the file plays, expected weight)
    ({}, 10.0, (1, None)),
    ({"n": "256"}, 10.0, (1, None)),  # without beam search vLLM ignores n
    ({"n": "256", "use_beam_search": "true"}, 10.0, (256, "n")),
    ({"n": "8", "use_beam_search": "On"}, 10.0, (8, "n")),  # pydantic: any case
    ({"n": "8", "use_beam_search": "1"}, 10.0, (8, "n")),
    ({"n": "8", "use_beam_search": "maybe"}, 10.0, (8, "n")),  # vLLM: 422; charged
    ({"n": "8", "use_beam_search": "false"}, 10.0, (1, None)),
    ({"n": "8", "use_beam_search": "No"}, 10.0, (1, None)),
    ({"n": "8", "use_beam_search": ""}, 10.0, (1, None)),  # FastAPI: the default
    ({"n": "", "use_beam_search": "true"}, 10.0, (1, None)),
    ({"n": " 6_4 ", "use_beam_search": "y"}, 10.0, (64, "n")),
    ({"n": "4.5", "use_beam_search": "t"}, 10.0, (5, "n")),
    ({}, 600.0, (21, "file")),  # 600 s: 21 clips of at least 29 s
    ({}, 29.0, (1, None)),
    ({}, 29.5, (2, "file")),
    ({"n": "4", "use_beam_search": "true"}, 120.0, (20, "file")),  # 5 clips x 4 beams
    ({"n": "16", "use_beam_search": "true"}, 120.0, (80, "n")),
    ({}, None, (21, "file")),  # unknown (allowed): as long as max_seconds
]


@pytest.mark.parametrize(("fields", "seconds", "expected"), SPEECH)
def test_weight_of_a_transcription(
    fields: dict[str, str], seconds: float | None, expected: tuple[int, Any]
) -> None:
    got = speech(_form(**fields), seconds, clip_seconds=29.0, max_seconds=600.0)
    assert got == expected


def test_a_form_count_that_cannot_be_read_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        speech(_form(n="lots", use_beam_search="true"), 1.0, clip_seconds=29.0, max_seconds=600.0)
