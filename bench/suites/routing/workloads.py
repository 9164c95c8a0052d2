"""Workloads for the routing benchmark: who shares which prefix, and how often.

Each workload is a list of sessions; a session's calls run one after another (a user
waits for the answer before the next turn), and sessions run concurrently. Everything is
generated from a seed, so every policy sees exactly the same requests in the same order.
The first `warmup` sessions are a warm-up drawn from the same distribution: the bench
replays them first and counts nothing of them, so the figures describe a gateway that has
been running (templates and shared prompts already cached somewhere), not the first
minute after every engine started empty.
Sizes are in the simulated engine's tokens (bench/sim/tokenizer.py: 4 bytes of UTF-8
per token), chosen so that one engine's KV cache holds about a quarter of a workload's
distinct prefixes: eviction decides the hit rate, as in the routing simulation (docs/facts.md).

- chat: multi-turn conversations sharing one long system prompt;
- few_shot: plain completions sharing a 3k-token few-shot prefix;
- images: three questions per image, from different users at different times;
- templates: many system-prompt templates of Zipf-distributed popularity.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bench.harness.samples import data_url, encode

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

_WORDS = [
    "account",
    "balance",
    "invoice",
    "shipment",
    "warranty",
    "refund",
    "policy",
    "customer",
    "order",
    "product",
    "delivery",
    "address",
    "payment",
    "method",
    "subscription",
    "renewal",
    "discount",
    "coupon",
    "support",
    "ticket",
    "escalation",
    "manager",
    "schedule",
    "meeting",
    "report",
    "analysis",
    "quarterly",
    "revenue",
    "forecast",
    "budget",
    "approval",
    "contract",
    "clause",
    "liability",
    "insurance",
    "claim",
    "premium",
    "deductible",
    "coverage",
    "network",
    "latency",
    "server",
    "cluster",
    "deployment",
    "rollback",
    "incident",
    "outage",
    "monitoring",
    "alert",
    "threshold",
    "capacity",
    "planning",
    "storage",
    "backup",
    "restore",
    "encryption",
    "certificate",
    "rotation",
]


@dataclass(frozen=True)
class Call:
    path: str
    body: dict[str, Any]
    # A later turn of a chat: `body["messages"]` holds only the new messages, which the
    # client sends after the previous turn's messages and the engine's reply to it, as
    # a chat client does (`follow`).
    follow_up: bool = False
    # What the call's engine should be shared with: its conversation (chat) or its image
    # (images). A call whose key was seen before is a follow-up for the agreement figure
    # (bench/README.md); None where every request is its own conversation.
    key: str | None = None


def follow(call: Call, previous: dict[str, Any] | None, reply: str) -> dict[str, Any]:
    """The body a client sends for `call`, given its session's previous body and the
    engine's reply to it."""
    if not call.follow_up or previous is None:
        return call.body
    messages = [*previous["messages"], {"role": "assistant", "content": reply}]
    return {**call.body, "messages": messages + call.body["messages"]}


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sessions: list[list[Call]]
    # Leading sessions replayed as a warm-up and left out of every figure.
    warmup: int = 0
    # Keys whose first call shares no KV block with any call answered or in flight before
    # it: on empty caches it finds nothing cached (the real-engine suite checks its
    # resets with them).
    cold_keys: frozenset[str] = frozenset()

    @property
    def calls(self) -> int:
        return sum(len(s) for s in self.sessions)

    @property
    def measured(self) -> list[list[Call]]:
        return self.sessions[self.warmup :]


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` simulated tokens of text (4 bytes each)."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def _chat_body(
    model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, **extra}


def chat(model: str, scale: float, rng: random.Random, max_tokens: int) -> Workload:
    """Each turn sends the whole conversation back, with the engine's own replies (100
    to 200 tokens: `ignore_eos` makes the simulated engine write exactly `max_tokens`)."""
    system = {"role": "system", "content": "You are Acme's support assistant. " + words(rng, 1500)}
    sessions: list[list[Call]] = []
    measured = max(4, round(48 * scale))
    warmup = measured // 2
    for index in range(warmup + measured):
        calls: list[Call] = []
        for turn in range(rng.randint(3, 6)):
            question = {"role": "user", "content": words(rng, rng.randint(30, 120))}
            reply = rng.randint(100, 200)
            body = _chat_body(model, [question], reply, ignore_eos=True)
            if turn == 0:
                body["messages"] = [system, question]
            calls.append(Call(CHAT, body, follow_up=turn > 0, key=f"conversation {index}"))
        sessions.append(calls)
    return Workload(
        "chat",
        f"{measured} conversations of 3-6 turns (replies of 100-200 tokens) sharing a"
        " 1,500-token system prompt",
        sessions,
        warmup,
    )


def few_shot(model: str, scale: float, rng: random.Random, max_tokens: int) -> Workload:
    examples = "".join(
        f"Q: {words(rng, 40)}\nA: {words(rng, 35)}\n\n" for _ in range(40)
    )  # ~3,000 tokens
    sessions = [
        [
            Call(
                COMPLETIONS,
                {
                    "model": model,
                    "prompt": examples + f"Q: {words(rng, rng.randint(20, 60))}\nA:",
                    "max_tokens": max_tokens,
                    "stream": True,
                },
            )
        ]
        for _ in range(max(8, round(160 * scale)) * 5 // 4)
    ]
    warmup = len(sessions) // 5
    return Workload(
        "few_shot",
        f"{len(sessions) - warmup} completions sharing a 3,000-token few-shot prefix",
        sessions,
        warmup,
    )


def png_data_url(index: int, side: int = 672) -> str:
    """A distinct PNG per index (672x672: 443 image tokens in the simulated Qwen3-VL)."""
    from PIL import Image, ImageDraw

    rng = random.Random(index)
    image = Image.new("RGB", (side, side), (rng.randrange(256), rng.randrange(256), 90))
    draw = ImageDraw.Draw(image)
    box = min(64, side // 2)
    for _ in range(6):
        x, y = rng.randrange(side - box), rng.randrange(side - box)
        draw.rectangle((x, y, x + box, y + box), fill=(rng.randrange(256), 40, rng.randrange(256)))
    return data_url("image/png", encode(image, "PNG"))


def images(model: str, scale: float, rng: random.Random, max_tokens: int) -> Workload:
    system = {"role": "system", "content": "Describe images precisely. " + words(rng, 200)}
    count = max(4, round(64 * scale))
    urls = [png_data_url(i) for i in range(count)]
    calls = [
        Call(
            CHAT,
            _chat_body(
                model,
                [
                    system,
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": urls[i]}},
                            {"type": "text", "text": words(rng, rng.randint(10, 40)) + "?"},
                        ],
                    },
                ],
                max_tokens,
            ),
            key=f"image {i}",
        )
        for i in range(count)
        for _ in range(3)
    ]
    # Questions about one image come from different users at different times. The first
    # third of the stream is the warm-up: the images asked about in it are cached
    # somewhere when the measured part asks about them again.
    rng.shuffle(calls)
    warmup = len(calls) // 3
    return Workload(
        "images",
        f"{count} images of 672x672, 3 questions each, in random order"
        f" ({len(calls) - warmup} measured after {warmup})",
        [[c] for c in calls],
        warmup,
    )


def templates(model: str, scale: float, rng: random.Random, max_tokens: int) -> Workload:
    count = 60
    prompts = [f"Template {i}. " + words(rng, rng.randint(300, 1200)) for i in range(count)]
    # Zipf popularity (s = 1.1): the top template carries ~20% of the requests.
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(count)]
    sessions = []
    measured = max(8, round(240 * scale))
    warmup = measured // 3
    for _ in range(warmup + measured):
        (template,) = rng.choices(prompts, weights)
        messages = [
            {"role": "system", "content": template},
            {"role": "user", "content": words(rng, rng.randint(20, 80))},
        ]
        sessions.append([Call(CHAT, _chat_body(model, messages, max_tokens))])
    return Workload(
        "templates",
        f"{measured} requests over {count} templates of 300-1,200 tokens, Zipf 1.1",
        sessions,
        warmup,
    )


GENERATORS = {"chat": chat, "few_shot": few_shot, "images": images, "templates": templates}


def build(
    names: list[str], model: str, scale: float = 1.0, seed: int = 5, max_tokens: int = 16
) -> list[Workload]:
    return [GENERATORS[n](model, scale, random.Random(f"{seed}:{n}"), max_tokens) for n in names]


def interleave(sessions: list[list[Call]], live: int) -> list[tuple[int, Call]]:
    """The order in which `replay` sends the calls when every answer is instant: `live`
    sessions open at once, each answered session to the back of the queue. Each call
    comes with the index of its session."""
    pending = iter(enumerate(sessions))
    ready: deque[tuple[int, Iterator[Call]]] = deque()

    def open_next(count: int) -> None:
        ready.extend((i, iter(s)) for i, s in itertools.islice(pending, count))

    open_next(live)
    order: list[tuple[int, Call]] = []
    while ready:
        index, session = ready.popleft()
        call = next(session, None)
        if call is None:
            open_next(1)
            continue
        order.append((index, call))
        ready.append((index, session))
    return order
