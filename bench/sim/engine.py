"""The simulated engine: caches, load, and the latency model.

Calibration (docs/vllm.md, Qwen3-VL-2B on an 8 GB laptop GPU, vLLM 0.31/0.32):
TTFT = 15 ms fixed + 16 ms per media item (load, hash, processor) + uncached prompt
tokens at 18,000 tokens/s + vision encoder time for items missing from the processor
cache, 0.1 ms x t + 0.000136 ms x t^2 for an item of t tokens (attention is quadratic).
That gives a new 448x448 image with a short question 68 ms, a new 896x896 one 238 ms,
and either again (image and prefix cached) 32 ms, the reference medians.
Prefill and encoder work is serialized (one GPU); the fixed part overlaps. Decode is
8 ms per token plus 0.05 ms per running request (a larger batch steps slower).
`--max-num-seqs` bounds the running set; the rest wait, shown as
`vllm:num_requests_waiting`.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Sequence
from types import TracebackType

from bench.sim import prompt
from bench.sim.cache import MediaSpan, PrefixCache, ProcessorCache, block_hashes
from bench.sim.config import SimConfig
from bench.sim.errors import invalid_body, model_not_found
from bench.sim.media import MediaConnector, MediaItem, MediaRef
from bench.sim.metrics import Metrics

BASE_TTFT = 0.015
PER_MEDIA_ITEM = 0.016
PREFILL_TOKENS_PER_S = 18_000.0
EMBED_TOKENS_PER_S = 21_900.0  # Qwen3-Embedding-0.6B reference: ~21,900 tokens/s
DECODE_STEP = 0.008
DECODE_STEP_PER_RUNNING = 0.00005


def encoder_seconds(tokens: int) -> float:
    return (0.1 * tokens + 0.000136 * tokens * tokens) / 1000.0


def prefill_seconds(
    uncached_tokens: int, media: Sequence[MediaItem], tokens_per_s: float = PREFILL_TOKENS_PER_S
) -> tuple[float, float]:
    """(fixed, compute) seconds to the first token on an idle engine. The fixed part
    overlaps with other requests; the compute part holds the GPU."""
    fixed = BASE_TTFT + PER_MEDIA_ITEM * len(media)
    compute = uncached_tokens / tokens_per_s + sum(
        encoder_seconds(m.tokens) for m in media if not m.cached
    )
    return fixed, compute


class Engine:
    """Everything one simulated engine owns. Built per app; no module state."""

    def __init__(self, config: SimConfig, media: MediaConnector) -> None:
        self.config = config
        self.media = media
        self.metrics = Metrics(config.names[0], config.block_size, config.kv_cache_tokens)
        self.prefix = PrefixCache(config.kv_cache_tokens, config.block_size)
        self.mm = ProcessorCache()
        self.loras: dict[str, str] = {}  # name -> path it was asked to read
        self.running = 0
        self.waiting = 0
        self.in_flight = 0
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._gpu = asyncio.Lock()
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)

    def request_id(self, given: str | None) -> str:
        """The client's X-Request-Id, as vLLM uses it, else a fresh unique id."""
        return given or f"{self._id_prefix}{next(self._ids):010x}"

    def resolve_model(self, model: object) -> tuple[str, str]:
        """(served name, LoRA name or "") for a request's `model`, vLLM's 404 if unknown."""
        names = self.config.names
        if model is None:
            return names[0], ""
        if not isinstance(model, str):
            raise invalid_body("model: Input should be a valid string")
        if model in names:
            return model, ""
        if model in self.loras:
            return model, model
        raise model_not_found(model, names)

    async def load_media(self, refs: Sequence[MediaRef]) -> list[MediaItem]:
        if not refs:
            return []
        datas = await asyncio.gather(*(self.media.load_bytes(r) for r in refs))
        items: list[MediaItem] = []
        for ref, data in zip(refs, datas, strict=True):
            digest = self.media.digest(data if ref.uuid is None else b"uuid\0" + ref.uuid.encode())
            self.metrics.mm_cache_queries += 1
            tokens = self.mm.get(digest)
            if tokens is not None:
                self.metrics.mm_cache_hits += 1
                items.append(MediaItem(ref.kind, digest, tokens, cached=True))
                continue
            tokens = await self.media.measure(ref.kind, data)
            self.mm.put(digest, tokens)
            items.append(MediaItem(ref.kind, digest, tokens, cached=False))
        return items

    def lookup_prefix(
        self, tokens: Sequence[int], spans: Sequence[MediaSpan], lora: str, salt: str
    ) -> tuple[int, list[bytes]]:
        """Cached tokens of a prompt, and its block hashes; counts the prefix cache query
        and its hits."""
        hashes = block_hashes(tokens, spans, self.config.block_size, lora, salt)
        cached = self.prefix.lookup(hashes, len(tokens))
        self.metrics.prefix_cache_queries += len(tokens)
        self.metrics.prefix_cache_hits += cached
        self.metrics.prompt_tokens += len(tokens)
        return cached, hashes

    def cache_reply(
        self,
        tokens: Sequence[int],
        spans: Sequence[MediaSpan],
        hashes: Sequence[bytes],
        reply: str,
        lora: str,
        salt: str,
    ) -> None:
        """Cache a finished chat reply's blocks after its prompt's (`tokens`, whose
        block `hashes` lookup_prefix gave), as vLLM's KV cache manager does while
        decoding; no prefix-cache query is counted."""
        size = self.config.block_size
        self.prefix.insert(prompt.reply_blocks(tokens, spans, hashes, reply, size, lora, salt))

    def decode_step(self) -> float:
        return DECODE_STEP + DECODE_STEP_PER_RUNNING * self.running


class EngineRequest:
    """One request's life in the engine: queue, prefill, decode, then release.

    Use as `async with EngineRequest(...) as seq:`; leaving by an exception (the client went
    away and the task was cancelled) counts an abort, as vLLM does when the connection
    closes.
    """

    def __init__(
        self,
        engine: Engine,
        uncached_tokens: int,
        media: Sequence[MediaItem] = (),
        tokens_per_s: float = PREFILL_TOKENS_PER_S,
    ) -> None:
        self.engine = engine
        self.zero = engine.config.zero
        self.uncached = uncached_tokens
        self.media = media
        self.rate = tokens_per_s
        self.arrival = time.perf_counter()
        self.finish_reason = "stop"
        self._admitted = False

    async def __aenter__(self) -> EngineRequest:
        self.engine.in_flight += 1
        try:
            await self._schedule()
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def _schedule(self) -> None:
        engine = self.engine
        if not self.zero:
            engine.waiting += 1
            try:
                await engine._slots.acquire()
            finally:
                engine.waiting -= 1
        engine.running += 1
        self._admitted = True
        started = time.perf_counter()
        engine.metrics.queue.observe(started - self.arrival)
        if not self.zero:
            fixed, compute = prefill_seconds(self.uncached, self.media, self.rate)
            await asyncio.sleep(fixed)
            async with engine._gpu:
                await asyncio.sleep(compute)
        engine.metrics.ttft.observe(time.perf_counter() - self.arrival)

    async def decode(self, tokens: int) -> None:
        if not self.zero and tokens > 0:
            await asyncio.sleep(self.engine.decode_step() * tokens)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        engine = self.engine
        engine.in_flight -= 1
        if self._admitted:
            engine.running -= 1
            if not self.zero:
                engine._slots.release()
        metrics = engine.metrics
        if exc_type is None:
            metrics.success(self.finish_reason)
            metrics.e2e.observe(time.perf_counter() - self.arrival)
        elif issubclass(exc_type, asyncio.CancelledError | OSError):
            metrics.success("abort")
