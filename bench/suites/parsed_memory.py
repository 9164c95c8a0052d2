"""What a parsed JSON body holds against what the body budget charges for it
(gateway/proxy/footprint.py `held_by`: a walk, or for many values `parsed_size`, the bound
from the bytes), shape by shape.

    python -m bench.suites.parsed_memory [--values N]

Each shape is a body of N values (200,000 by default) parsed by `orjson.loads` under
tracemalloc; the table gives the bytes held per body byte and each charge's ratio to
them: the walk's, and the bound's. A ratio under 1.00 is a shape charged short.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from collections.abc import Callable

import orjson

from gateway.proxy.footprint import parsed_size


def held(raw: bytes) -> int:
    """Bytes `orjson.loads(raw)` holds while its result lives."""
    gc.collect()
    tracemalloc.start()
    try:
        parsed = orjson.loads(raw)
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del parsed
    return size


def walk(raw: bytes) -> int:
    """gateway/proxy/footprint.py `held_by`'s walk of the parsed body, whatever its size and
    objects (it counts instead for small bodies and bodies of many objects)."""
    parsed = orjson.loads(raw)
    size = 0
    stack = [parsed]
    while stack:
        obj = stack.pop()
        size += sys.getsizeof(obj)
        if isinstance(obj, dict):
            size += sum(sys.getsizeof(key) for key in obj)
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)
    return size


def _joined(n: int, item: Callable[[int], str], open_: str = "[", close: str = "]") -> bytes:
    return (open_ + ",".join(item(i) for i in range(n)) + close).encode()


def shapes(n: int) -> dict[str, bytes]:
    """Bodies of `n` values each: text, numbers, containers, members, wide characters."""
    text = "x" * 4 * n
    message = {"role": "user", "content": "hello there " * 10}
    return {
        "ascii string": json.dumps({"a": text}).encode(),
        "ascii + one emoji": json.dumps({"a": text + "\U0001f600"}, ensure_ascii=False).encode(),
        "ascii + escaped emoji": json.dumps({"a": text + "\U0001f600"}).encode(),
        "ascii + one cjk": json.dumps({"a": text + "\u4e2d"}, ensure_ascii=False).encode(),
        "empty lists": b"[" + b"[]," * n + b"0]",
        "empty dicts": b"[" + b"{}," * n + b"0]",
        "small ints": b"[" + b"1," * n + b"0]",
        "token ids": b"[" + b"12345," * n + b"0]",
        "floats": b"[" + b"1.5," * n + b"0]",
        "true": b"[" + b"true," * n + b"0]",
        "1-char strings": b"[" + b'"a",' * n + b"0]",
        "unique strings": _joined(n, lambda i: f'"s{i}"'),
        "cjk strings": _joined(n, lambda i: f'"\u4e2d{i}"'),
        "emoji keys": _joined(n, lambda i: f'"\U0001f600{i}":0', "{", "}"),
        "members": _joined(n, lambda i: f'"k{i}":0', "{", "}"),
        "members, string values": _joined(n, lambda i: f'"k{i}":"v{i}"', "{", "}"),
        "one-member objects": _joined(n, lambda i: f'{{"k{i}":1}}'),
        "nested objects": b"[" + b'{"a":{"b":{}}},' * n + b"0]",
        "8-member objects": b"["
        + b'{"a":1,"b":1,"c":1,"d":1,"e":1,"f":1,"g":1,"h":1},' * n
        + b"0]",
        "nested lists": b"[" + b"[[[]]]," * n + b"0]",
        "chat": json.dumps({"model": "m", "messages": [message] * (n // 10)}).encode(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.suites.parsed_memory")
    parser.add_argument("--values", type=int, default=200_000, help="values per shape")
    args = parser.parse_args()
    print(f"{'shape':24} {'body bytes':>11} {'held':>12} {'held/byte':>9} {'walk':>6} {'bound':>6}")
    for name, raw in shapes(args.values).items():
        real = held(raw)
        walked, bound = walk(raw), parsed_size(raw)
        print(
            f"{name:24} {len(raw):>11,} {real:>12,} {real / len(raw):>9.2f} "
            f"{walked / real:>6.2f} {bound / real:>6.2f}"
        )


if __name__ == "__main__":
    main()
