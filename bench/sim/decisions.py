"""/v1/systemone: vLLM 0.32's structured decisions (entrypoints/generate/structured_decisions).

Each question is read from one prompt (the state, the instructions, the question); the
answer keys `answers` and `diagnostics` by the client's question ids, with `usage`
between them (`StructuredDecisionResponse`). vLLM serves it on six architectures and
answers 501 on the others; the simulator serves it on every model.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from bench.sim import tokenizer
from bench.sim.engine import Engine, EngineRequest
from bench.sim.errors import bad_request, invalid_body
from bench.sim.http import Request, respond_json


def _probs(qid: str, count: int) -> list[float]:
    weights = [
        1 + hashlib.blake2b(f"{qid}/{i}".encode(), digest_size=1).digest()[0] for i in range(count)
    ]
    total = sum(weights)
    return [w / total for w in weights]


def _answer(qid: str, spec: dict[str, Any]) -> dict[str, Any]:
    kind = spec.get("type")
    criteria = spec.get("criteria")
    if kind == "noul":
        probs = _probs(qid, 2)
        return {
            "type": "noul",
            "noul": probs[0],
            "probabilities": {"yes": probs[0], "no": probs[1]},
            "confidence": max(probs),
        }
    if kind == "choice" and isinstance(criteria, dict) and criteria:
        names = [str(n) for n in criteria]
        probs = _probs(qid, len(names))
        top = max(range(len(names)), key=probs.__getitem__)
        return {
            "type": "choice",
            "choice": names[top],
            "probabilities": dict(zip(names, probs, strict=True)),
            "confidence": probs[top],
        }
    if kind == "score" and isinstance(criteria, list) and len(criteria) >= 2:
        probs = _probs(qid, len(criteria))
        return {
            "type": "score",
            "score": sum(i * p for i, p in enumerate(probs)),
            "legend": {str(i): str(c) for i, c in enumerate(criteria)},
            "probabilities": {str(i): p for i, p in enumerate(probs)},
            "confidence": max(probs),
        }
    raise bad_request(f"question {qid!r}: unknown type or criteria", "questions")


async def decide(engine: Engine, req: Request) -> None:
    body = req.json()
    model, _ = engine.resolve_model(body.get("model"))
    questions = body.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise invalid_body("questions: Input should be a non-empty dictionary")
    if "state" not in body:
        raise invalid_body("state: Field required")
    state = body["state"] if isinstance(body["state"], str) else repr(body["state"])
    base = len(tokenizer.encode(f"{body.get('instructions') or ''}\n{state}"))
    answers: dict[str, Any] = {}
    diagnostics: dict[str, Any] = {}
    input_tokens = 0
    for qid, spec in questions.items():
        if not isinstance(spec, dict):
            raise invalid_body(f"questions.{qid}: Input should be an object")
        answers[qid] = _answer(qid, spec)
        diagnostics[qid] = {"label_mass": 0.9, "argmax_is_label": True}
        input_tokens += base + len(tokenizer.encode(str(spec.get("instructions") or qid)))
    async with EngineRequest(engine, input_tokens) as seq:
        await seq.decode(1)
    rid = engine.request_id(req.header(b"x-request-id"))
    await respond_json(
        req.send,
        {
            "id": f"decision-{rid}",
            "object": "structured_decision",
            "created": int(time.time()),
            "model": model,
            "answers": answers,
            # One label token read a question.
            "usage": {"input_tokens": input_tokens, "output_tokens": len(questions)},
            "diagnostics": diagnostics,
        },
    )
