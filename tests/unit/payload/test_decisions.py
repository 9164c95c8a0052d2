"""gateway/payload/decisions.py: a /v1/systemone request whose answer could echo too
much of it to be parsed for its usage is refused."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.payload.decisions import ANSWER_LIMIT, check_echoes

BIG = ANSWER_LIMIT // 2 + 1


@pytest.mark.parametrize(
    ("questions", "refused"),
    [
        ({"q": {"type": "noul"}}, False),
        ({f"q{i}": {"type": "choice", "criteria": {"a": None}} for i in range(64)}, False),
        ({"x" * 1000: {"type": "noul"}}, False),
        # The id is written twice: `answers` and `diagnostics`.
        ({"x" * BIG: {"type": "noul"}}, True),
        # Escaped as the answer writes it (6 bytes a control character).
        ({"\x01" * (BIG // 5): {"type": "noul"}}, True),
        ({"q": {"type": "choice", "criteria": {"y" * BIG: None, "n": None}}}, True),
        ({"q": {"type": "score", "criteria": ["a", [["z" * (2 * BIG)]]]}}, True),
        # Levels and criteria of other types are not echoed.
        ({"q": {"type": "noul", "criteria": {"true": "z" * (4 * BIG)}}}, False),
        ({"q": {"type": "score", "criteria": {"z" * (4 * BIG): 1}}}, False),
        # Not an object: left for vLLM to refuse.
        ([{"x" * (4 * BIG): 1}], False),
        (None, False),
    ],
)
def test_answers_that_could_not_be_parsed_are_refused(questions: Any, refused: bool) -> None:
    body = {"model": "m", "state": "s", "questions": questions}
    if refused:
        with pytest.raises(InvalidRequest) as info:
            check_echoes(body)
        assert (info.value.code, info.value.param) == ("invalid_request", "questions")
    else:
        check_echoes(body)
