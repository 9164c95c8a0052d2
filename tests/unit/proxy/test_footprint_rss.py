"""The body budget's charge for a parsed body against the memory the process really
holds for it: resident pages, read in a fresh interpreter, not tracemalloc.

tracemalloc reports the sizes objects ask for; pymalloc hands out blocks rounded up to
16 bytes, so a 1-character str asks for 50 bytes and holds 64. The charge
(gateway/proxy/footprint.py) was fitted to tracemalloc, so for bodies of many short
distinct strings it stays below what the parse holds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import ROOT

# Resident memory counted in 4 KiB pages, whatever the machine's transparent huge pages
# setting (PR_SET_THP_DISABLE for the measuring process), with the collector off
# (nothing freed between the two reads).
_PRELUDE = """
import ctypes, gc, json, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)
import orjson
from gateway.proxy.footprint import held_by

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

gc.disable()
"""

# Prints what `held_by` charges for the body and the resident bytes its parse added.
_MEASURE = (
    _PRELUDE
    + """
raw = sys.stdin.buffer.read()
before = resident()
parsed = orjson.loads(raw)
after = resident()
print(json.dumps({"charged": held_by(parsed, raw), "resident": after - before}))
"""
)


def _charged_and_resident(script: str, bodies: bytes) -> dict[str, int]:
    """Runs `script` in a fresh interpreter on `bodies` (its stdin): what it printed."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=bodies,
        capture_output=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    figures: dict[str, int] = json.loads(out.stdout)
    return figures


def _short_strings(n: int, width: int) -> bytes:
    # orjson makes a new str for each, even of one character (no cached singletons).
    items = ",".join(f'"{i % 10**width:0{width}d}"' for i in range(n))
    return b'{"stop":[' + items.encode("ascii") + b"]}"


@pytest.mark.parametrize("width", [1, 2, 16])
def test_the_charge_covers_the_resident_memory_of_many_short_strings(width: int) -> None:
    """500,000 strings of 1, 2 or 16 characters (`{"stop":["0","1",...]}`): a 2.0 to 9.5
    MB body of 500,000 values, within the default `max_json_values` and `max_body_bytes`.
    The charge must be at least the resident memory the parse added. On the code before:
    30.0 MB charged for 36.4 MB resident at 1 character, 30.5 for 36.4 at 2, 37.5 for
    44.4 at 16: each str asks 50, 51 or 65 bytes and holds 64, 64 or 80."""
    figures = _charged_and_resident(_MEASURE, _short_strings(500_000, width))
    assert figures["charged"] >= figures["resident"], figures


# Parses the bodies, charges each as the gateway does (`held_by`), then writes each parsed
# object back with orjson.dumps, as the handler does for a body it rewrote (a stream
# asked for its usage, proxy/metering.py; `Handler._inspect`), the written bytes
# discarded: prints the charge and the resident bytes the parsed objects then hold.
_MEASURE_REWRITTEN = (
    _PRELUDE
    + """
raws = [line for line in sys.stdin.buffer.read().split(b"\\n") if line]
before = resident()
parsed = [orjson.loads(raw) for raw in raws]
charged = sum(held_by(body, raw) for body, raw in zip(parsed, raws))
for body in parsed:
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    orjson.dumps(body)
after = resident()
print(json.dumps({"charged": charged, "resident": after - before}))
"""
)


def _streamed_chats(text: str, count: int) -> bytes:
    bodies = (
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"{text}{i}"}]}
        for i in range(count)
    )
    return b"\n".join(json.dumps(body, ensure_ascii=False).encode() for body in bodies)


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("é" * 2000, 3000),  # 4.1 KB bodies: walked since the 2 KiB switch
        ("中" * 1500, 3000),  # 4.6 KB bodies, two bytes a character
        ("é" * 100_000, 60),  # 200 KB bodies: walked over 64 KiB before too
    ],
)
def test_the_charge_covers_a_walked_body_once_the_gateway_has_rewritten_it(
    text: str, count: int
) -> None:
    """A streamed chat of non-ASCII text over `WALK_OVER` is charged by its walk
    (`sys.getsizeof` of each str: one or two bytes a character), and then rewritten by
    the gateway (orjson.dumps, to ask for the stream's usage): orjson caches each
    non-ASCII str's UTF-8 inside it (two or three bytes more a character), held until the
    parsed object is dropped, after the engines are ordered (the shared store's round
    trip included). Found by an attacker's review (2026-12-06): 3,000 bodies of 2,000
    'é' charged 9.0 MB for 20.1 MB resident (2.2x under), '中' 12.0 MB for 24.7 MB, 60
    bodies of 100,000 'é' 6.1 MB for 18.2 MB (3.0x). The count the walk replaced for
    2-64 KiB bodies (two bytes per body byte for non-ASCII) charged 28.3 and 31.3 MB:
    the first two cases pass on the code before 2e4ac91; the third fails there too
    (walked over 64 KiB)."""
    figures = _charged_and_resident(_MEASURE_REWRITTEN, _streamed_chats(text, count))
    assert figures["charged"] >= figures["resident"], figures
