"""Pooling routes: /v1/embeddings, /pooling, /classify, /score, /rerank and their
versioned twins, with the bodies of vllm/entrypoints/pooling/*/protocol.py.

Embeddings are hashed character trigrams, normalized, so texts that share words are
close; rerank and score use word overlap with the query, so the lexically matching
document comes first (the reference reranker put it first at 0.993).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
import time
from collections.abc import Callable, Coroutine
from typing import Any

from bench.sim import prompt, tokenizer
from bench.sim.engine import EMBED_TOKENS_PER_S, Engine, EngineRequest
from bench.sim.errors import invalid_body
from bench.sim.http import Request, respond_json
from bench.sim.media import MediaItem

DIMENSIONS = 1024  # Qwen3-Embedding-0.6B
_WORD = re.compile(r"\w+")


def embed(text: str, dimensions: int = DIMENSIONS) -> list[float]:
    vector = [0.0] * dimensions
    padded = f"  {text.lower()} "
    for i in range(len(padded) - 2):
        h = int.from_bytes(hashlib.blake2b(padded[i : i + 3].encode(), digest_size=4).digest())
        vector[h % dimensions] += 1.0 if h & 0x80000000 else -1.0
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def relevance(query: str, document: str) -> float:
    """Word overlap of the document with the query, squashed into (0, 1)."""
    q = set(_WORD.findall(query.lower()))
    d = set(_WORD.findall(document.lower()))
    if not q or not d:
        return 0.001
    overlap = len(q & d) / len(q)
    return round(1.0 / (1.0 + math.exp(-(12.0 * overlap - 6.0))), 6)


async def _inputs(engine: Engine, body: dict[str, Any]) -> tuple[list[str], list[MediaItem]]:
    """Texts of `input`, or one rendered chat for `messages` (media fetched)."""
    if "messages" in body:
        segments = prompt.chat_segments(body["messages"])
        items = await engine.load_media(prompt.media_refs(segments))
        text = "".join(s for s in segments if isinstance(s, str))
        return [text + "".join(f"<{i.digest.hex()}>" for i in items)], items
    if "input" not in body:
        raise invalid_body("input: Field required")
    return prompt.text_inputs(body["input"], "input"), []


async def _score_input(engine: Engine, value: Any, field: str) -> list[str]:
    """A score/rerank input: a string, `{"content": [parts]}`, or a list of those."""
    values = value if isinstance(value, list) else [value]
    out: list[str] = []
    for v in values:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict) and "content" in v:
            segments = prompt.content_segments(v["content"], field)
            items = await engine.load_media(prompt.media_refs(segments))
            text = " ".join(s for s in segments if isinstance(s, str))
            out.append(text + "".join(f" <{i.digest.hex()}>" for i in items))
        else:
            raise invalid_body(f"{field}: Input should be a string or an object with content")
    if not out:
        raise invalid_body(f"{field}: at least one input is required")
    return out


def _count(texts: list[str]) -> int:
    return sum(len(tokenizer.encode(t)) for t in texts)


async def _run(engine: Engine, tokens: int, items: list[MediaItem]) -> None:
    engine.metrics.prompt_tokens += tokens
    async with EngineRequest(engine, tokens, items, EMBED_TOKENS_PER_S):
        pass


def _usage(tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _head(prefix: str, model: str, engine: Engine, req: Request) -> dict[str, Any]:
    rid = engine.request_id(req.header(b"x-request-id"))
    return {"id": f"{prefix}-{rid}", "object": "list", "created": int(time.time()), "model": model}


# One row of a per-input answer, from the input's index and text.
Row = Callable[[int, str], dict[str, Any]]


async def _answer_each(
    engine: Engine, req: Request, prefix: str, row_for: Callable[[dict[str, Any]], Row]
) -> None:
    """What embeddings, pooling and classify share: the inputs run on the engine, then one
    row per input. `row_for(body)` checks the route's own fields (after the inputs, as
    vLLM does) and returns the row builder."""
    body = req.json()
    model, _ = engine.resolve_model(body.get("model"))
    texts, items = await _inputs(engine, body)
    row = row_for(body)
    tokens = _count(texts)
    await _run(engine, tokens, items)
    data = [row(index, text) for index, text in enumerate(texts)]
    await respond_json(
        req.send, {**_head(prefix, model, engine, req), "data": data, "usage": _usage(tokens)}
    )


def _embedding_row(body: dict[str, Any]) -> Row:
    dims = body.get("dimensions")
    if dims is not None and (type(dims) is not int or not 1 <= dims <= DIMENSIONS):
        raise invalid_body(f"dimensions: Input should be an integer from 1 to {DIMENSIONS}")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", "bytes", "bytes_only"):
        raise invalid_body(
            "encoding_format: Input should be 'float', 'base64', 'bytes' or 'bytes_only'"
        )

    def row(index: int, text: str) -> dict[str, Any]:
        vector: Any = embed(text, dims or DIMENSIONS)
        if fmt == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return {"index": index, "object": "embedding", "embedding": vector}

    return row


def _pooling_row(index: int, text: str) -> dict[str, Any]:
    return {"index": index, "object": "pooling", "data": embed(text)}


def _classify_row(index: int, text: str) -> dict[str, Any]:
    p = (hashlib.blake2b(text.encode(), digest_size=2).digest()[0] + 0.5) / 256.0
    label = 0 if p >= 0.5 else 1
    return {"index": index, "label": f"LABEL_{label}", "probs": [p, 1.0 - p], "num_classes": 2}


async def embeddings(engine: Engine, req: Request) -> None:
    fmt = req.json().get("encoding_format")
    if fmt in ("bytes", "bytes_only"):
        await _embeddings_bytes(engine, req, fmt)
    else:
        await _answer_each(engine, req, "embd", _embedding_row)


async def _embeddings_bytes(engine: Engine, req: Request, fmt: str) -> None:
    """A binary answer (vllm/entrypoints/pooling/utils.py,
    `build_pooling_bytes_streaming_response`): the vectors as float32, back to back, in a
    streamed body; with `bytes` the `metadata` header describes them and holds the usage,
    with `bytes_only` there is no header and no usage anywhere."""
    body = req.json()
    model, _ = engine.resolve_model(body.get("model"))
    texts, items = await _inputs(engine, body)
    _embedding_row(body)
    tokens = _count(texts)
    await _run(engine, tokens, items)
    chunks: list[bytes] = []
    rows: list[dict[str, Any]] = []
    offset = 0
    for index, text in enumerate(texts):
        vector = embed(text)
        chunk = struct.pack(f"<{len(vector)}f", *vector)
        rows.append(
            {
                "index": index,
                "embed_dtype": "float32",
                "endianness": "native",
                "start": offset,
                "end": offset + len(chunk),
                "shape": [len(vector)],
            }
        )
        chunks.append(chunk)
        offset += len(chunk)
    headers = [(b"content-type", b"application/octet-stream")]
    if fmt == "bytes":
        head = _head("embd", model, engine, req)
        metadata = {
            "id": head["id"],
            "created": head["created"],
            "model": model,
            "data": rows,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        headers.append((b"metadata", json.dumps(metadata).encode()))
    await req.send({"type": "http.response.start", "status": 200, "headers": headers})
    for chunk in chunks:
        await req.send({"type": "http.response.body", "body": chunk, "more_body": True})
    await req.send({"type": "http.response.body", "body": b""})


async def pooling(engine: Engine, req: Request) -> None:
    await _answer_each(engine, req, "pool", lambda _body: _pooling_row)


async def classify(engine: Engine, req: Request) -> None:
    await _answer_each(engine, req, "classify", lambda _body: _classify_row)


_SCORE_FIELDS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


async def score(engine: Engine, req: Request) -> None:
    body = req.json()
    model, _ = engine.resolve_model(body.get("model"))
    for left, right in _SCORE_FIELDS:
        if left in body and right in body:
            break
    else:
        raise invalid_body("Expected `queries` and `documents` (or `text_1` and `text_2`).")
    firsts = await _score_input(engine, body[left], left)
    seconds = await _score_input(engine, body[right], right)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise invalid_body(f"`{left}` must have one item or as many as `{right}`.")
    tokens = _count(firsts) + _count(seconds)
    await _run(engine, tokens, [])
    data = [
        {"index": i, "object": "score", "score": relevance(a, b)}
        for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
    ]
    await respond_json(
        req.send, {**_head("score", model, engine, req), "data": data, "usage": _usage(tokens)}
    )


async def rerank(engine: Engine, req: Request) -> None:
    body = req.json()
    model, _ = engine.resolve_model(body.get("model"))
    if "query" not in body or "documents" not in body:
        raise invalid_body("`query` and `documents` are required.")
    query = (await _score_input(engine, body["query"], "query"))[0]
    documents = await _score_input(engine, body["documents"], "documents")
    top_n = body.get("top_n", 0)
    if type(top_n) is not int or top_n < 0:
        raise invalid_body("top_n: Input should be a non-negative integer")
    tokens = _count([query]) * len(documents) + _count(documents)
    await _run(engine, tokens, [])
    results = sorted(
        (
            {"index": i, "document": {"text": d}, "relevance_score": relevance(query, d)}
            for i, d in enumerate(documents)
        ),
        key=lambda r: -float(r["relevance_score"]),  # type: ignore[arg-type]
    )
    if top_n:
        results = results[:top_n]
    rid = engine.request_id(req.header(b"x-request-id"))
    await respond_json(
        req.send,
        {
            "id": f"rerank-{rid}",
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        },
    )


Handler = Callable[[Engine, Request], Coroutine[Any, Any, None]]

INVOCATION_KEYS: tuple[tuple[str, Handler], ...] = (
    ("input", embeddings),
    ("messages", embeddings),
    ("query", rerank),
    ("queries", score),
    ("text_1", score),
    ("data_1", score),
)
