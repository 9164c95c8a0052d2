"""What a parsed JSON body holds in memory, for the body budget (gateway/proxy/budget.py).

    size = held_by(orjson.loads(raw), raw)

Two measures, both at or above what `orjson.loads` holds (tests/unit/proxy/test_body.py
checks each against tracemalloc over bench/suites/parsed_memory.py's shapes,
tests/unit/proxy/test_footprint_rss.py the count against resident memory): a walk of
the parsed objects, for a large body of few objects (an image, long text); an upper bound
counted from the bytes, for small bodies and bodies of many objects, where it costs less.
"""

from __future__ import annotations

import re
import sys
from typing import Any

# What a parsed body holds at most beyond its characters, for each byte of the body that
# can make an object: `[` a list, `{` a dict (with its first entries' table), `,` a value
# in a list or a member (its pointer, and a number or a string's header), `:` a member
# (its key, its slot). Counted inside strings too: an upper bound. At or above the
# resident memory orjson.loads adds (pymalloc's blocks, in steps of 16 bytes, not the
# sizes tracemalloc reports) over the shapes of docs/facts.md, "What a parsed body
# holds": strings of 1 to 16 characters 1.02-1.04x, members 1.1x, ints 1.9x, `{},` 2.9x
# (the singletons `true` and `null` cost only their pointer).
PARSED_PER_LIST = 80
PARSED_PER_DICT = 136
PARSED_PER_ITEM = 72
PARSED_PER_MEMBER = 92
# A str with a character past U+007F has a larger header (`PyCompactUnicodeObject`):
# charged on each item and member of a body that may hold one (100,000 strings `"中1"`
# hold 94 bytes each).
PARSED_WIDE_HEADER = 32
# Characters of a str take 1, 2 or 4 bytes, by the widest in the string: 4 for any
# character past U+FFFF (a UTF-8 lead byte F0-F4, or a surrogate escape `\ud8`-`\udb`),
# then 2 for any other non-ASCII byte or `\u` escape (an upper bound). One emoji in
# a 30 MiB ASCII string makes it 120 MiB.
_FOUR_BYTE_CHARS = re.compile(rb"[\xf0-\xf4]|\\u[dD][89abAB]")
# Every byte but the four that can make an object: deleting them leaves those four, which
# are then counted in a fraction of the body (one pass instead of four; callgrind, a
# 6.4 KB chat: 102K instructions instead of 171K).
_NOT_OBJECT_BYTES = bytes(b for b in range(256) if b not in b"[{,:")


def parsed_size(raw: bytes) -> int:
    """An upper bound of what `orjson.loads(raw)` holds, in bytes: its characters at
    their widest, and the weights above for each byte that can make an object. Counting
    passes over the bytes, ~0.3 ms a MiB each: for a body of many values, where walking
    them (`held_by`) would cost more."""
    header = 0
    if raw.isascii() and raw.find(b"\\u") < 0:
        width = 1
    else:
        width = 4 if _FOUR_BYTE_CHARS.search(raw) is not None else 2
        header = PARSED_WIDE_HEADER
    marks = raw.translate(None, _NOT_OBJECT_BYTES)
    size = (
        width * len(raw)
        + PARSED_PER_LIST * marks.count(b"[")
        + PARSED_PER_DICT * marks.count(b"{")
        + (PARSED_PER_ITEM + header) * marks.count(b",")
        + (PARSED_PER_MEMBER + header) * marks.count(b":")
    )
    return size


# Bodies over this size are walked (`held_by`) rather than counted (`parsed_size`): a
# chat of a few long messages is a few objects for its bytes. A 6.4 KB chat of 17
# objects: walked in 3.4 us, counted in 9.0 us (callgrind: the counting passes were
# ~90K instructions of it); a walk that gives up (too many objects) wastes at most what
# counting costs.
WALK_OVER = 2 * 1024
# Body bytes per object walked at most: the walk costs ~180 ns an object, the counting
# passes ~1.2 ns a byte in all, so past one object for 128 bytes counting costs less.
WALK_BYTES_PER_OBJECT = 128
# pymalloc hands out blocks in steps of 16 bytes (tests/unit/proxy/test_footprint_rss.py).
BLOCK_STEP = 16
# A str that is not ASCII comes to hold its UTF-8 as well (at most 4 bytes a character)
# when the gateway writes the body back (orjson caches it inside the str; a stream asked
# for its usage, proxy/metering.py), held while the parsed body is.
UTF8_PER_CHAR = 4


def held_by(parsed: Any, raw: bytes) -> int:
    """What the parsed body `raw` holds, in bytes: over `WALK_OVER`, each object's
    `sys.getsizeof` rounded up to `BLOCK_STEP` (shared and interned ones counted each
    time: an upper bound), and a str that is not ASCII its UTF-8 too (`UTF8_PER_CHAR`),
    while there are few objects for its size; else `parsed_size(raw)`. A large body is
    mostly a few long strings (an image is one): its walk takes microseconds, where
    counting 1.3 MB of base64 took ~3 ms."""
    if len(raw) <= WALK_OVER:
        return parsed_size(raw)
    size = 0
    left = len(raw) // WALK_BYTES_PER_OBJECT
    stack = [parsed]
    getsizeof = sys.getsizeof
    while stack:
        obj = stack.pop()
        left -= 1
        if left < 0:
            return parsed_size(raw)
        # Rounded up to pymalloc's step: a small object holds a whole block.
        size += (getsizeof(obj) + BLOCK_STEP - 1) & -BLOCK_STEP
        kind = type(obj)
        if kind is dict:
            left -= len(obj)
            for key in obj:
                size += (getsizeof(key) + BLOCK_STEP - 1) & -BLOCK_STEP
                if not key.isascii():
                    size += UTF8_PER_CHAR * len(key)
            stack.extend(obj.values())
        elif kind is list:
            stack.extend(obj)
        elif kind is str and not obj.isascii():
            size += UTF8_PER_CHAR * len(obj)
    return size
