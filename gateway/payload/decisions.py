"""The bound on what a /v1/systemone answer echoes of its request.

vLLM 0.32 answers with `answers` and `diagnostics`, each keyed by the request's question
ids, around the top-level `usage` (vllm/entrypoints/generate/structured_decisions:
`StructuredDecisionResponse`); a `choice` answer also names its options twice (`choice`
and the keys of `probabilities`), a `score` answer its levels once (`legend`). The
gateway reads the usage by parsing the answer whole, up to `proxy.usage.WHOLE_LIMIT`
(4 MiB): a request whose echoes could push its answer past that is refused before the
engine, so no client chooses to go unmetered. Nothing else in the answer grows with the
request: vLLM asks at most 64 questions of at most 26 options, and each answer's
numbers take under `_PER_QUESTION` bytes.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from gateway.errors import InvalidRequest

# The most an answer may take by the request's count (its echoes as JSON, and
# `_PER_QUESTION` a question): half the answer's parse limit.
ANSWER_LIMIT: Final = 2 * 1024 * 1024
# An answer's own bytes for one question, past the names it echoes (a choice of 26
# options writes ~1.3 KB of probabilities), with room to spare.
_PER_QUESTION: Final = 4096


def _json_size(text: str) -> int:
    # As the answer writes it: escapes included (a control character takes 6 bytes).
    return len(orjson.dumps(text))


def _option_echoes(spec: Any) -> int:
    """Bytes of a question's option names or levels its answer echoes."""
    if type(spec) is not dict:
        return 0
    criteria = spec.get("criteria")
    kind = spec.get("type")
    if kind == "choice" and type(criteria) is dict:
        # `Option(str(name))`: the name is written as `choice` and as a key.
        return 2 * sum(_json_size(str(name)) for name in criteria)
    if kind == "score" and type(criteria) is list:
        # `legend` maps each level's index to `str(level)`.
        return sum(_json_size(str(level)) for level in criteria)
    return 0


def check_echoes(body: dict[str, Any]) -> None:
    """Refuses a /v1/systemone body whose answer could take more than `ANSWER_LIMIT`
    bytes with its question ids, option names and levels (vLLM reads `questions` as
    an object; anything else is left for it to refuse)."""
    questions = body.get("questions")
    if type(questions) is not dict:
        return
    size = len(questions) * _PER_QUESTION
    for qid, spec in questions.items():
        # Keyed twice: `answers` and `diagnostics`.
        size += 2 * _json_size(qid) + _option_echoes(spec)
        if size > ANSWER_LIMIT:
            raise InvalidRequest(
                "The questions' ids, option names and levels are too long.",
                param="questions",
            )
