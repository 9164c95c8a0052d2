"""The body budget's charge for a parsed body against the memory the process really
holds for it: resident pages, read in a fresh interpreter, not tracemalloc.

tracemalloc reports the sizes objects ask for; pymalloc hands out blocks rounded up to
16 bytes, so a 2-character str asks for 51 bytes and holds 64. The charge
(gateway/proxy/footprint.py) was fitted to tracemalloc, so for bodies of many short
distinct strings it stays below what the parse holds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import ROOT

# Prints what `held_by` charges for the body and the resident bytes its parse added,
# with the collector off (nothing freed between the two reads).
_MEASURE = """
import gc, json, sys
import orjson
from gateway.proxy.footprint import held_by

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

raw = sys.stdin.buffer.read()
gc.disable()
before = resident()
parsed = orjson.loads(raw)
after = resident()
print(json.dumps({"charged": held_by(parsed, raw), "resident": after - before}))
"""


def _short_strings(n: int, width: int) -> bytes:
    # Distinct enough that none is one of CPython's cached one-character strings.
    items = ",".join(f'"{i % 10**width:0{width}d}"' for i in range(n))
    return b'{"stop":[' + items.encode("ascii") + b"]}"


@pytest.mark.parametrize("width", [2, 16])
def test_the_charge_covers_the_resident_memory_of_many_short_strings(width: int) -> None:
    """500,000 strings of 2 (or 16) characters: a 2.5 MB (9.5 MB) body, 500,000 values,
    within the default `max_json_values` and `max_body_bytes`. The charge must be at
    least the resident memory the parse added (on the code before: 30.5 MB charged for
    36.4 MB resident at width 2, 37.5 MB for 44.4 MB at width 16)."""
    raw = _short_strings(500_000, width)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE],
        input=raw,
        capture_output=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    figures = json.loads(out.stdout)
    assert figures["charged"] >= figures["resident"], figures
