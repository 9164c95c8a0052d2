"""`python -m bench.suites.walk`: what the body walk costs, against parsing the same body.

The walk (gateway/payload/walk.py) looks at every object of every JSON body, so its cost
grows with the number of objects, not with the bytes. Bodies from 1 KB to 30 MB, in four
shapes: a chat with many short text turns, the same with long turns, one large inline
image (a few objects, many bytes), and tool schemas (deeply nested objects). Each is
timed parsing (orjson.loads, which every JSON request pays anyway) and walking, in the
same process and run, interleaved; the report gives the walk as a ratio to the parse.
No I/O: the walk checks and collects, resolving media is timed by the reference suite.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.suites.report import RESULTS, SMOKE
from gateway.media.settings import MediaSettings
from gateway.media.urls import UrlPolicy
from gateway.payload.fields import FieldRules
from gateway.payload.identity import Identity
from gateway.payload.settings import PayloadSettings
from gateway.payload.walk import Walk

SIZES = (1_000, 30_000, 1_000_000, 30_000_000)


def _chat(size: int, turn_chars: int) -> dict[str, Any]:
    turn = ("word " * (turn_chars // 5))[:turn_chars]
    messages: list[dict[str, Any]] = [{"role": "system", "content": turn}]
    while len(messages) * (turn_chars + 40) < size:
        role = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role, "content": [{"type": "text", "text": turn}]})
    return {"model": "m", "messages": messages}


def _image(size: int) -> dict[str, Any]:
    data = base64.b64encode(b"\x89PNG" + b"\0" * max(0, size * 3 // 4 - 200)).decode()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
    text = {"type": "text", "text": "what is this?"}
    return {"model": "m", "messages": [{"role": "user", "content": [text, part]}]}


def _tools(size: int) -> dict[str, Any]:
    def schema(depth: int) -> dict[str, Any]:
        if depth == 0:
            return {"type": "string", "description": "a leaf"}
        return {"type": "object", "properties": {f"p{i}": schema(depth - 1) for i in range(3)}}

    tool = {"type": "function", "function": {"name": "f", "parameters": schema(5)}}
    one = len(json.dumps(tool))
    tools = [tool for _ in range(max(1, size // one))]
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}


SHAPES: dict[str, Callable[[int], dict[str, Any]]] = {
    "chat, 200-char turns": lambda n: _chat(n, 200),
    "chat, 5,000-char turns": lambda n: _chat(n, 5_000),
    "one inline image": _image,
    "tool schemas": _tools,
}


def _objects(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(_objects(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_objects(v) for v in value)
    return 0


def measure(raw: bytes, repeats: int) -> tuple[list[float], list[float]]:
    """Interleaved timings of parsing `raw` and walking the parsed body."""
    media = MediaSettings(max_bytes=64 * 1024 * 1024, max_items=64)
    policy = UrlPolicy(media)
    payload = PayloadSettings()
    identity = Identity("bench", "bench", b"0" * 32)
    fields = FieldRules(media, payload)
    parse, walk = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        body = orjson.loads(raw)
        t1 = time.perf_counter()
        Walk(media, fields, policy, identity).run(body)
        t2 = time.perf_counter()
        parse.append(t1 - t0)
        walk.append(t2 - t1)
    return parse, walk


def run(sizes: Sequence[int], out: Path, smoke: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, build in SHAPES.items():
        for size in sizes:
            body = build(size)
            raw = orjson.dumps(body)
            repeats = max(5, min(200, 3_000_000 // max(1, len(raw))))
            parse, walk = measure(raw, repeats)
            p, w = statistics.median(parse), statistics.median(walk)
            rows.append({"shape": label, "bytes": len(raw), "objects": _objects(body),
                         "repeats": repeats, "parse_ms": p * 1e3, "walk_ms": w * 1e3,
                         "walk_per_parse": w / p if p else 0.0})  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "report.md").write_text(report(rows, smoke))
    return rows


def report(rows: Sequence[dict[str, Any]], smoke: bool = False) -> str:
    lines = [
        "# Body walk cost (`python -m bench.suites.walk`)",
        "",
        *([f"**{SMOKE}** (`--quick`: the two smallest bodies).", ""] if smoke else []),
        "Median per body; the walk as a ratio to parsing the same body in the same run.",
        "",
        "| shape | body | objects | parse (orjson) | walk | walk / parse |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['bytes'] / 1e6:.3f} MB | {r['objects']:,} | "
            f"{r['parse_ms']:.3f} ms | {r['walk_ms']:.3f} ms | {r['walk_per_parse']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.suites.walk", description=__doc__)
    p.add_argument("--quick", action="store_true", help="only the 1 KB and 30 KB bodies")
    p.add_argument(
        "--out",
        type=Path,
        help="results folder (default bench/results/latest/walk; with --quick "
        "bench/results/walk-quick, so that a smoke run never replaces the measurement)",
    )
    args = p.parse_args(argv)
    out = args.out or RESULTS / ("walk-quick" if args.quick else "latest/walk")
    rows = run(SIZES[:2] if args.quick else SIZES, out, args.quick)
    print(report(rows, args.quick))


if __name__ == "__main__":
    main()
