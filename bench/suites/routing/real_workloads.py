"""Seeded workloads for routing on real engines (`bench routing --real-vllm`).

Sizes are in words of the models' word list, one BPE token each (the tiny and big
models share the tokenizer, bench/harness/realvllm/models.py), chosen so that a first
prefill of a shared prompt costs hundreds of milliseconds on llama-big.

Every call carries its whole prompt: a chat turn sends the conversation so far with
assistant replies written from the seed, not taken from an engine, so every front end
is sent byte-identical prompts (a random model's replies differ with the batch it ran
in). The calls of one session run in order, each after the previous one's answer.

- chat: conversations of 6-10 turns under 4 shared system prompts of 1,000-2,000 words;
  the same workload, on engines with a small KV cache, is the eviction workload;
- few_shot: single requests over 12 few-shot templates (700-1,800 words, in the system
  message) of Zipf(1.1) popularity;
- images: generated PNG images (448-672 px a side, `data:` URLs), each asked several
  questions by one request each, in random order, under one shared system prompt.

With a warm-up, each workload also has sessions of its own kind under the same shared
prompts (conversations, template requests, images: keys of their own, drawn after the
measured ones, so those stay byte-identical), replayed first and left out of the figures:
the measured part then meets a fleet that has served its shared prompts, as a gateway
that runs for days does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from bench.harness.realvllm.models import WORDS
from bench.harness.samples import data_url, encode
from bench.suites.routing.workloads import CHAT, Call, Workload

EVICTION = "chat_evict"


@dataclass(frozen=True)
class Sizes:
    """How much of each workload: the full run's, `quick`'s, or the real tier's test's."""

    conversations: int = 36
    systems: int = 4
    turns: tuple[int, int] = (6, 10)
    system_words: tuple[int, int] = (1000, 2000)
    user_words: tuple[int, int] = (15, 60)
    reply_words: tuple[int, int] = (40, 100)
    templates: int = 12
    template_words: tuple[int, int] = (700, 1800)
    requests: int = 240
    images: int = 24
    questions: int = 5
    sides: tuple[int, ...] = (448, 504, 560, 616, 672)
    # The warm-up's sessions, with `warm_up`: conversations, template requests, images.
    warm_conversations: int = 12
    warm_requests: int = 80
    warm_images: int = 8


FULL = Sizes()
QUICK = Sizes(
    conversations=12, turns=(4, 7), requests=60, images=8, questions=3,
    warm_conversations=4, warm_requests=20, warm_images=3,
)  # fmt: skip
WARM = "warm-up "
# For tiny-llama's 2,048-token context.
TINY = Sizes(
    conversations=6,
    turns=(3, 4),
    system_words=(300, 500),
    reply_words=(20, 40),
    user_words=(10, 30),
)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _body(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def chat(
    model: str, sizes: Sizes, rng: random.Random, max_tokens: int, warm: bool = False
) -> Workload:
    systems = [
        f"System prompt {i}. " + words(rng, rng.randint(*sizes.system_words))
        for i in range(sizes.systems)
    ]

    def conversation(index: int, prefix: str) -> list[Call]:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": systems[index % sizes.systems]}
        ]
        calls = []
        for turn in range(rng.randint(*sizes.turns)):
            user = f"Turn {turn}. " + words(rng, rng.randint(*sizes.user_words))
            messages = [*messages, {"role": "user", "content": user}]
            body = _body(model, messages, max_tokens)
            calls.append(Call(CHAT, body, key=f"{prefix}conversation {index}"))
            reply = words(rng, rng.randint(*sizes.reply_words))
            messages = [*messages, {"role": "assistant", "content": reply}]
        return calls

    sessions = [conversation(i, "") for i in range(sizes.conversations)]
    warm_up = [conversation(i, WARM) for i in range(sizes.warm_conversations if warm else 0)]
    # The first conversation under each system prompt ("System prompt <i>." sets them
    # apart in the first block): the sessions open in order, and with fewer clients than
    # half the prompts, the next conversation under a prompt starts after its first
    # conversation's first turn was answered.
    cold = frozenset(f"conversation {i}" for i in range(min(sizes.systems, sizes.conversations)))
    return Workload(
        "chat",
        f"{sizes.conversations} conversations of {sizes.turns[0]}-{sizes.turns[1]} turns"
        f" under {sizes.systems} shared system prompts of {sizes.system_words[0]:,}-"
        f"{sizes.system_words[1]:,} words",
        [*warm_up, *sessions],
        warmup=len(warm_up),
        # After a warm-up no key is cold.
        cold_keys=frozenset() if warm_up else cold,
    )


def few_shot(
    model: str, sizes: Sizes, rng: random.Random, max_tokens: int, warm: bool = False
) -> Workload:
    templates = []
    for i in range(sizes.templates):
        budget = rng.randint(*sizes.template_words)
        examples: list[str] = []
        count = 0
        while count < budget:
            question, answer = rng.randint(15, 40), rng.randint(20, 60)
            examples.append(f"Question: {words(rng, question)}\nAnswer: {words(rng, answer)}")
            count += question + answer + 4
        templates.append(f"Template {i}. Answer like the examples.\n" + "\n\n".join(examples))
    # Zipf popularity, s = 1.1: the top template carries about a third of the requests.
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(sizes.templates)]

    def request() -> list[Call]:
        (index,) = rng.choices(range(sizes.templates), weights)
        messages = [
            {"role": "system", "content": templates[index]},
            {"role": "user", "content": "Question: " + words(rng, rng.randint(20, 60))},
        ]
        return [Call(CHAT, _body(model, messages, max_tokens), key=f"template {index}")]

    sessions = [request() for _ in range(sizes.requests)]
    warm_up = [request() for _ in range(sizes.warm_requests if warm else 0)]
    return Workload(
        "few_shot",
        f"{sizes.requests} requests over {sizes.templates} few-shot templates of"
        f" {sizes.template_words[0]:,}-{sizes.template_words[1]:,} words, Zipf 1.1",
        # None cold: a template's first request and its second may be in flight at
        # once, and the engine may schedule the second first.
        [*warm_up, *sessions],
        warmup=len(warm_up),
    )


def png_data_url(rng: random.Random, width: int, height: int) -> str:
    """A PNG of coloured rectangles and ellipses, drawn from `rng`."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (rng.randrange(256), rng.randrange(256), 90))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(8, 20)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1 = min(width, x0 + rng.randint(20, width // 2))
        y1 = min(height, y0 + rng.randint(20, height // 2))
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape((x0, y0, x1, y1), fill=colour)
    return data_url("image/png", encode(image, "PNG"))


def images(
    model: str, sizes: Sizes, rng: random.Random, max_tokens: int, warm: bool = False
) -> Workload:
    system = {"role": "system", "content": "You describe images. " + words(rng, 400)}

    def asked(count: int, prefix: str) -> list[list[Call]]:
        urls = [
            png_data_url(rng, rng.choice(sizes.sides), rng.choice(sizes.sides))
            for _ in range(count)
        ]
        asks = [(i, q) for i in range(count) for q in range(sizes.questions)]
        rng.shuffle(asks)
        sessions = []
        for i, q in asks:
            content: list[dict[str, Any]] = [
                {"type": "image_url", "image_url": {"url": urls[i]}},
                {"type": "text", "text": f"Question {q}: " + words(rng, rng.randint(10, 30))},
            ]
            messages: list[dict[str, Any]] = [system, {"role": "user", "content": content}]
            body = _body(model, messages, max_tokens)
            sessions.append([Call(CHAT, body, key=f"{prefix}image {i}")])
        return sessions

    sessions = asked(sizes.images, "")
    warm_up = asked(sizes.warm_images if warm else 0, WARM)
    return Workload(
        "images",
        f"{sizes.images} images of {min(sizes.sides)}-{max(sizes.sides)} px a side, asked"
        f" {sizes.questions} questions each in random order",
        # None cold: every call shares the system prompt's blocks, and the first two
        # are in flight at once (measured: the second scheduled first, its image smaller).
        [*warm_up, *sessions],
        warmup=len(warm_up),
    )


GENERATORS = {"chat": chat, "few_shot": few_shot, "images": images, EVICTION: chat}
NAMES = tuple(GENERATORS)


def build(
    name: str,
    model: str,
    sizes: Sizes = FULL,
    seed: int = 0,
    max_tokens: int = 8,
    warm_up: bool = False,
) -> Workload:
    """The workload `name`, with its warm-up sessions first when `warm_up`; the
    eviction workload is the chat workload (same seed), renamed."""
    source = "chat" if name == EVICTION else name
    rng = random.Random(f"real:{seed}:{source}")
    workload = GENERATORS[name](model, sizes, rng, max_tokens, warm_up)
    if name != EVICTION:
        return workload
    return Workload(
        EVICTION,
        workload.description + ", on engines that evict",
        workload.sessions,
        warmup=workload.warmup,
        cold_keys=workload.cold_keys,
    )
