"""How many sequences a request makes the engine run: its weight against the key's
in-flight cap and rate (gateway/access/admission.py).

One HTTP request can put many sequences into vLLM's scheduler: every prompt of a list,
every conversation of a batch, `n` samples (or beams) of each. Read from vLLM 0.32's
source (docs/gateway.md, "Per-key limits", has the table):

    /v1/chat/completions          n (beam search: n beams, each an engine request)
    /v1/chat/completions/batch    conversations x n (vLLM refuses n > 1 there)
    /v1/completions               prompts (`prompt` and `prompt_embeds`) x n
    /v1/embeddings, /pooling,     prompts of `input`, or conversations of `messages`
      /classify
    /v2/embed                     texts + images + inputs
    /score, /v1/score             both sides: a bi-encoder embeds each text once; a
                                  cross-encoder runs one pair per document (fewer)
    /rerank, /v1/rerank,          the query and each document (as /score)
      /v2/rerank
    /generative_scoring           items
    /v1/systemone                 questions (one engine request each)
    /invocations                  the heaviest of the shapes above (vLLM takes the
                                  first that validates)
    /v1/audio/transcriptions,     the clips the audio is cut into x `n` with
      /v1/audio/translations      `use_beam_search` (multipart form fields: `speech`)
    anything else                 1

`best_of` counts as `n` where it is larger: vLLM 0.32 ignores it, older engines ran that
many. Numbers are read the way vLLM's pydantic reads them (`"64"`, `64.0` and `"6_4"`
are 64); a count the gateway cannot read is refused, never taken for 1. The weight is
an upper bound: where vLLM runs fewer sequences than a shape allows, the key is
charged for the larger count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gateway.errors import InvalidRequest

# (weight, the body field that makes it: named in a refusal)
Weight = tuple[int, str | None]
_ONE: Weight = (1, None)


def _number(body: dict[str, Any], name: str) -> int:
    """`body[name]` as vLLM's pydantic reads an int field, rounded up; 1 when absent or
    null. A value no reading turns into a number is refused."""
    value = body.get(name)
    if value is None:
        return 1
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return math.ceil(value)
    if isinstance(value, str) and len(value) <= 64:
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            if math.isfinite(number):
                return math.ceil(number)
    raise InvalidRequest(f"`{name}` must be an integer.", param=name)


def _samples(body: dict[str, Any]) -> Weight:
    """Sequences per prompt: `n` (samples, or beams with `use_beam_search`), or
    `best_of` where larger."""
    n = _number(body, "n")
    if "best_of" in body:
        best_of = _number(body, "best_of")
        if best_of > n:
            return best_of, "best_of"
    return n, "n"


def _prompts(value: object) -> int:
    """Prompts in a `prompt` or `input` value: a string, a list of token ids or one
    conversation (a list of message objects) is one; any other list is one per item.
    vLLM's `prompt_to_seq` reads a list as token ids by its first item; every item is
    checked here, so a list that could be read either way counts as its length."""
    if not isinstance(value, list):
        return 0 if value is None else 1
    for item in value:
        if isinstance(item, dict) or (isinstance(item, int) and not isinstance(item, bool)):
            continue
        return len(value)
    return 1 if value else 0


def _conversations(value: object) -> int:
    """Conversations in `messages`: a list of lists is a batch, anything else one."""
    if isinstance(value, list) and value and all(isinstance(c, list) for c in value):
        return len(value)
    return 0 if value is None else 1


def _items(value: object) -> int:
    """Items of a scoring side, a Cohere list or a dict of questions: one per list item
    or key, else one."""
    if isinstance(value, list | dict):
        return len(value)
    return 0 if value is None else 1


def _times(count: int, param: str, body: dict[str, Any]) -> Weight:
    """`count` prompts of `_samples` each; named by the larger factor."""
    samples, by = _samples(body)
    count, samples = max(count, 1), max(samples, 1)
    return count * samples, param if count >= samples else by


def chat(body: dict[str, Any]) -> Weight:
    if body.get("n") is None and "best_of" not in body:
        return _ONE
    samples, by = _samples(body)
    return (samples, by) if samples > 1 else _ONE


def chat_batch(body: dict[str, Any]) -> Weight:
    return _times(_conversations(body.get("messages")), "messages", body)


def completion(body: dict[str, Any]) -> Weight:
    count = _prompts(body.get("prompt")) + _prompts(body.get("prompt_embeds"))
    return _times(count, "prompt", body)


def pooling(body: dict[str, Any]) -> Weight:
    inputs = _prompts(body.get("input"))
    conversations = _conversations(body.get("messages"))
    if conversations > inputs:
        return conversations, "messages"
    return max(inputs, 1), "input"


def cohere_embed(body: dict[str, Any]) -> Weight:
    count = sum(_items(body.get(name)) for name in ("texts", "images", "inputs"))
    return max(count, 1), "texts"


# The request types of /score (vLLM's ScoreRequest): their two sides.
_SCORE_SIDES = (
    ("data_1", "data_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("text_1", "text_2"),
)


def score(body: dict[str, Any]) -> Weight:
    best = _ONE
    for first, second in _SCORE_SIDES:
        count = _items(body.get(first)) + _items(body.get(second))
        if count > best[0]:
            best = (count, second)
    return best


def rerank(body: dict[str, Any]) -> Weight:
    return 1 + _items(body.get("documents")), "documents"


def generative_scoring(body: dict[str, Any]) -> Weight:
    return max(_items(body.get("items")), 1), "items"


def decisions(body: dict[str, Any]) -> Weight:
    return max(_items(body.get("questions")), 1), "questions"


def invocations(body: dict[str, Any]) -> Weight:
    """SageMaker's route takes the first request type that validates: charged as the
    heaviest of them."""
    return max((w(body) for w in (chat, completion, pooling, score, rerank)), key=lambda w: w[0])


WEIGHERS: dict[str, Callable[[dict[str, Any]], Weight]] = {
    "/v1/chat/completions": chat,
    "/v1/chat/completions/batch": chat_batch,
    "/v1/completions": completion,
    "/v1/embeddings": pooling,
    "/pooling": pooling,
    "/classify": pooling,
    "/v2/embed": cohere_embed,
    "/score": score,
    "/v1/score": score,
    "/rerank": rerank,
    "/v1/rerank": rerank,
    "/v2/rerank": rerank,
    "/generative_scoring": generative_scoring,
    "/v1/systemone": decisions,
    "/invocations": invocations,
}


# The values pydantic reads as False for a bool field (any case); "" is the default
# (FastAPI drops an empty form field). Anything else is beam search (or a 422).
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def speech(
    fields: Mapping[str, list[str]],
    seconds: float | None,
    *,
    clip_seconds: float,
    max_seconds: float,
) -> Weight:
    """The engine sequences of a transcription or translation: its multipart form
    `fields` (one value each, as the upload parser keeps them) and its file's playing
    time (`seconds`; None when unknown and allowed: counted as `max_seconds`).

    vLLM 0.32 (entrypoints/speech_to_text/base/serving.py) cuts audio longer than the
    model's clip into clips of at least `clip_seconds` and sends one engine request per
    clip, all at once. With `use_beam_search`, each is a beam search of width `n`
    (generate/beam_search/online.py: one engine request per beam at every step); without
    it `n` is ignored. Form values are strings, read as pydantic reads them: an empty
    one is absent."""
    values = {name: v[0] for name, v in fields.items() if v and v[0] != ""}
    played = max_seconds if seconds is None else seconds
    clips = max(math.ceil(played / clip_seconds), 1)
    beam = values.get("use_beam_search")
    beams = _number(values, "n") if beam is not None and beam.lower() not in _FALSE else 1
    beams = max(beams, 1)
    weight = clips * beams
    if weight <= 1:
        return _ONE
    return weight, "n" if beams >= clips else "file"


def sequences(path: str, body: dict[str, Any] | None) -> Weight:
    """The engine sequences the request to route `path` with `body` (parsed JSON; None:
    not JSON) makes the engine run, at least 1, and the field that makes them."""
    if body is None:
        return _ONE
    weigh = WEIGHERS.get(path)
    if weigh is None:
        return _ONE
    weight, param = weigh(body)
    return (weight, param) if weight > 1 else _ONE
