"""The prefix cache and the multimodal processor cache, modelled on vLLM v1.

Prefix cache: a full block's hash is H(parent hash, token ids, extra keys); extra keys
carry the hash and offset of each media item the block overlaps, the LoRA name, and the
`cache_salt` (first block only), as in vllm/v1/core/kv_cache_utils.py. Only full blocks
are cached, and at least one prompt token is always recomputed, so a prompt of exactly
k blocks hits at most k-1 of them. Like vLLM, which caches each block of generated tokens
as it fills, a chat reply's blocks are cached too (generate.py), so the next turn of the
conversation, which sends the reply back, hits on it. Eviction is least recently used over
`capacity // block_size` blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MediaSpan:
    """Placeholder tokens [start, end) of one media item, and the item's content hash."""

    start: int
    end: int
    digest: bytes


def block_hashes(
    tokens: Sequence[int],
    spans: Sequence[MediaSpan],
    block_size: int,
    lora: str = "",
    cache_salt: str = "",
    *,
    start: int = 0,
    parent: bytes = b"",
) -> list[bytes]:
    """Hashes of the full blocks from block `start` on; `parent` is the hash of block
    `start - 1` when the chain is continued (a reply after its prompt)."""
    hashes: list[bytes] = []
    lora_key = lora.encode()
    for index in range(start, len(tokens) // block_size):
        start = index * block_size
        end = start + block_size
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("Q", tokens[start:end]).tobytes())
        for span in spans:
            if span.start < end and span.end > start:
                h.update(span.digest)
                h.update((start - span.start).to_bytes(8, "big", signed=True))
        if lora_key:
            h.update(b"lora:" + lora_key)
        if index == 0 and cache_salt:
            h.update(b"salt:" + cache_salt.encode())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """LRU set of block hashes, sized in tokens like `--kv-cache-tokens`."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.capacity = max(1, capacity_tokens // block_size)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def usage(self) -> float:
        return len(self._blocks) / self.capacity

    def lookup(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Cached prompt tokens for this request; then its blocks become most recent."""
        limit = min(len(hashes), max(0, num_tokens - 1) // self.block_size)
        hits = 0
        blocks = self._blocks
        while hits < limit and hashes[hits] in blocks:
            hits += 1
        self.insert(hashes)
        return hits * self.block_size

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Cache these blocks (or refresh them) as the most recent; evict the oldest."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class ProcessorCache:
    """The multimodal processor cache: processed items keyed by the content hash."""

    def __init__(self, capacity_items: int = 512) -> None:
        self.capacity = capacity_items
        self._items: OrderedDict[bytes, int] = OrderedDict()

    def get(self, digest: bytes) -> int | None:
        tokens = self._items.get(digest)
        if tokens is not None:
            self._items.move_to_end(digest)
        return tokens

    def put(self, digest: bytes, tokens: int) -> None:
        self._items[digest] = tokens
        self._items.move_to_end(digest)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
