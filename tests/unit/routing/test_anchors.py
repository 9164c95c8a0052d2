"""Candidate anchors and the hot-candidate window: tables of small cases."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest

from gateway.routing.anchors import Anchor, AnchorKind, session_anchor
from tests.unit.routing.tunables import HotCandidates, candidate_anchors


def is_hot(hot: HotCandidates, anchor: Anchor, engines: int) -> bool:
    """Whether requests carrying `anchor` spread over more than one engine."""
    return hot.spread(anchor, engines) > 1.0


SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def image(url: str = "https://img.example/a.png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def placed(body: dict[str, Any], digests: list[str]) -> dict[str, str]:
    """`digests` as the payload walk reports them: by the path of each image part, in
    order (`messages[1].content[0].image_url.url`)."""
    out: dict[str, str] = {}
    given = iter(digests)
    field = "messages" if "messages" in body else "input"
    for mi, message in enumerate(body.get(field) or []):
        content = message.get("content") if isinstance(message, dict) else None
        for pi, part in enumerate(content if isinstance(content, list) else []):
            digest = next(given, None) if isinstance(part, dict) and "image_url" in part else None
            if digest is not None:
                out[f"{field}[{mi}].content[{pi}].image_url.url"] = digest
    return out


def kinds(body: dict[str, Any], hashes: list[str] | None = None) -> list[str]:
    return [a.kind.value for a in candidate_anchors(body, placed(body, hashes or []))]


@pytest.mark.parametrize(
    ("body", "hashes", "expected"),
    [
        (chat(SYSTEM, user("hi")), [], ["system", "first_user"]),
        (chat(user("hi")), [], ["first_user"]),
        (
            chat(SYSTEM, user("hi"), {"role": "assistant", "content": "yo"}, user("more")),
            [],
            ["system", "first_user", "message", "message"],
        ),
        (
            chat(SYSTEM, user([image(), text("what is it?")])),
            ["h1"],
            ["system", "media", "first_user"],
        ),
        # The cut is after the *last* media item of the first user message.
        (
            chat(user([image(), text("and"), image("b"), text("?")])),
            ["h1", "h2"],
            ["media", "first_user"],
        ),
        # Media in later messages gives no media anchor of its own.
        (
            chat(user("a"), {"role": "assistant", "content": "b"}, user([image()])),
            ["h1"],
            ["first_user", "message", "message"],
        ),
        (
            chat(SYSTEM, {"role": "developer", "content": "d"}, user("x")),
            [],
            ["system", "first_user"],
        ),
        (chat(SYSTEM), [], ["end"]),
        ({"model": "m", "prompt": "x" * 1100}, [], ["block", "block", "end"]),
        ({"model": "m", "prompt": "x" * 1024}, [], ["block", "block"]),
        ({"model": "m", "prompt": ""}, [], ["end"]),
        ({"model": "m", "input": "embed me"}, [], ["end"]),
        ({"model": "m", "prompt": [1, 2, 3]}, [], ["end"]),
        ({"model": "m", "prompt": ["first of a batch", "second"]}, [], ["end"]),
        (
            {"model": "m", "instructions": "be brief", "input": [user("hi")]},
            [],
            ["system", "first_user"],
        ),
    ],
)
def test_candidate_boundaries(body: dict[str, Any], hashes: list[str], expected: list[str]) -> None:
    assert kinds(body, hashes) == expected


@pytest.mark.parametrize(
    "body",
    [
        None,
        {},
        {"model": "m"},
        {"model": 5, "messages": []},
        {"messages": "not a list"},
        {"messages": [1, None, "x", {"role": 5, "content": {"a": 1}}]},
        {"messages": [{"role": "user", "content": [None, 3, {"type": "text", "text": 4}]}]},
        {"messages": [{"role": "user", "content": [{"image_url": {"url": 7}}]}]},
        {"prompt": [1, 2**70]},
        {"prompt": [True, False]},
        {"prompt": {"nested": "dict"}},
        {"prompt": "\ud800 lone surrogate"},
        {"input": [[1, 2], [3]]},
    ],
)
def test_odd_bodies_never_raise(body: Any) -> None:
    anchors = candidate_anchors(body, {"messages[0].content[0].image_url.url": "h"})
    assert all(len(a.digest) == 16 for a in anchors)


def _deep(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def _part(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [fields]}]}


# Any JSON shape yields anchors or none, never an exception (found once: a part whose
# `type` was a list made routing raise, a 500 with two or more engines).
WEIRD = [
    _part(type=["image_url"], image_url={"url": "https://a.example/x.png"}),
    _part(type={"image_url": 1}, text="hi"),
    _part(type=[], text="hi"),
    _part(type={}),
    _part(type=3, text="hi"),
    _part(type=2.5),
    _part(type=None, text="hi"),
    _part(type=True),
    _part(type="image_url", image_url=["a", "b"]),
    _part(type="image_url", image_url={"url": {"nested": [1]}}),
    _part(type="text", text=["a", {"b": 1}]),
    _part(image_url={"url": None, "data": 5}),
    _part(source={"type": "url", "url": ["x"]}),
    _part(input_audio=[1, 2, 3]),
    {"model": "m", "messages": [{"role": "user", "content": {"type": "text", "text": "hi"}}]},
    {"model": "m", "messages": [{"role": "user", "content": 42}]},
    {"model": "m", "messages": [{"role": "user", "content": None}]},
    {"model": "m", "messages": [{"role": ["user"], "content": "hi"}]},
    {"model": "m", "messages": [{"role": {"r": 1}, "content": [{"type": ["x"]}]}]},
    {"model": "m", "messages": {"role": "user", "content": "hi"}},
    {"model": "m", "messages": [[{"role": "user", "content": "hi"}]]},
    {"model": "m", "messages": [{"role": "system", "content": [{"type": {}}]}]},
    {"model": ["m"], "cache_salt": {"s": 1}, "messages": [{"role": "user", "content": "x"}]},
    {"model": {"a": 1}, "prompt": "x"},
    {"model": "m", "instructions": ["x"], "input": [{"role": "user", "content": [{"type": []}]}]},
    {"model": "m", "input": [{"type": ["message"], "content": [{"type": {"k": "v"}}]}]},
    {"model": "m", "prompt": [None, "x"]},
    {"model": "m", "prompt": [[[1, 2]]]},
    {"model": "m", "prompt": [{"a": 1}, {"b": 2}]},
    {"model": "m", "prompt": [1.5, 2]},
    {"model": "m", "prompt": [-(2**63) - 1]},
    {"model": "m", "prompt": 12},
    {"model": "m", "prompt": None, "input": None},
    # Nesting as deep as orjson parses (1,024): nothing recurses on it.
    {"model": "m", "prompt": _deep(1000, "x")},
    {"model": "m", "input": _deep(1000, 1)},
    {"model": "m", "messages": [{"role": "user", "content": [_deep(1000, {"type": "text"})]}]},
]


@pytest.mark.parametrize("body", WEIRD)
def test_weird_shapes_never_raise(body: Any) -> None:
    one = {"messages[0].content[0].image_url.url": "h1"}
    for media in ({}, one, {**one, "messages[0].content[1]": "h2", "input[0]": "h3"}):
        anchors = candidate_anchors(body, media)
        assert all(len(a.digest) == 16 for a in anchors)
    assert len(session_anchor(body, "s").digest) == 16


def test_a_part_with_a_list_type_is_keyed_by_its_media_keys() -> None:
    # An unhashable `type` is no reason to skip the part's media: vLLM picks a part's
    # kind by key presence when `type` is not one it knows.
    weird = _part(type=["x"], image_url={"url": "https://a.example/1.png"})
    other = _part(type=["x"], image_url={"url": "https://a.example/2.png"})
    assert kinds(weird) == ["media", "first_user"]
    assert candidate_anchors(weird)[0].digest != candidate_anchors(other)[0].digest


def test_turns_of_a_conversation_share_their_prefix_anchors() -> None:
    turn1 = chat(SYSTEM, user("plan a trip"))
    turn2 = chat(
        SYSTEM, user("plan a trip"), {"role": "assistant", "content": "ok"}, user("to Oslo")
    )
    a1 = candidate_anchors(turn1)
    a2 = candidate_anchors(turn2)
    assert [a.digest for a in a2[: len(a1)]] == [a.digest for a in a1]
    assert a2[-1].digest not in {a.digest for a in a1}


def test_same_image_different_questions_share_the_media_anchor() -> None:
    at = "messages[1].content[0].image_url.url"
    q1 = candidate_anchors(chat(SYSTEM, user([image(), text("colour?")])), {at: "sha256:aa"})
    q2 = candidate_anchors(chat(SYSTEM, user([image(), text("count?")])), {at: "sha256:aa"})
    other = candidate_anchors(chat(SYSTEM, user([image(), text("colour?")])), {at: "sha256:bb"})
    assert q1[1].kind is AnchorKind.media
    assert q1[1].digest == q2[1].digest
    assert q1[2].digest != q2[2].digest
    # The content hash, not the URL, is the identity of a validated item.
    assert other[1].digest != q1[1].digest


def test_media_without_matching_hashes_falls_back_to_the_url() -> None:
    body_a = chat(user([image("https://a.example/1.png"), text("?")]))
    body_b = chat(user([image("https://a.example/2.png"), text("?")]))
    assert candidate_anchors(body_a)[0].digest != candidate_anchors(body_b)[0].digest
    assert candidate_anchors(body_a)[0].digest == candidate_anchors(body_a)[0].digest


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (chat(user("x")), chat(user("x"), model="other")),
        (chat(user("x")), chat(user("x"), cache_salt="tenant-1")),
        (chat(user("x"), cache_salt="tenant-1"), chat(user("x"), cache_salt="tenant-2")),
        (chat(user("x")), chat({"role": "assistant", "content": "x"})),
        (chat(user("ab")), chat(user(["a", "b"]))),
        ({"model": "m", "prompt": "x"}, chat(user("x"))),
    ],
)
def test_different_streams_give_different_anchors(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert {x.digest for x in candidate_anchors(a)}.isdisjoint(
        {x.digest for x in candidate_anchors(b)}
    )


def test_plain_prompts_sharing_a_prefix_share_its_blocks() -> None:
    shared = "Example: question -> answer. " * 100  # 2,900 bytes: 5 whole blocks
    a = candidate_anchors({"model": "m", "prompt": shared + "What is 2+2?"})
    b = candidate_anchors({"model": "m", "prompt": shared + "Name a colour."})
    assert [x.digest for x in a[:5]] == [x.digest for x in b[:5]]
    assert a[5].digest != b[5].digest


def test_candidates_are_capped_keeping_the_shortest() -> None:
    body = {"model": "m", "prompt": "y" * 512 * 100}
    anchors = candidate_anchors(body, max_candidates=10)
    assert len(candidate_anchors(body, max_candidates=1000)) == 100
    assert anchors == candidate_anchors(body, max_candidates=1000)[:10]


def test_session_anchor_depends_on_model_session_and_key_only() -> None:
    a = session_anchor(chat(user("x")), "s1", b"key-a")
    assert a == session_anchor(chat(user("something else")), "s1", b"key-a")
    assert a != session_anchor(chat(user("x")), "s2", b"key-a")
    assert a != session_anchor(chat(user("x"), model="other"), "s1", b"key-a")
    # Another key naming the same session gets another anchor.
    assert a != session_anchor(chat(user("x")), "s1", b"key-b")
    assert a.kind is AnchorKind.session


# --- the hot-candidate window -----------------------------------------------------------


def conv(i: int, turns: int = 1) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [SYSTEM, user(f"conversation {i}")]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t}"}, user(f"follow-up {t}")]
    return chat(*messages)


def test_shared_system_prompt_spreads_once_two_conversations_carry_it() -> None:
    hot = HotCandidates(window=100, min_count=8)
    system = candidate_anchors(conv(0))[0]
    assert system.kind is AnchorKind.system
    hot.observe(candidate_anchors(conv(0)))
    assert hot.spread(system, engines=4) == 1.0  # one conversation: nothing branches yet
    hot.observe(candidate_anchors(conv(1)))
    assert hot.spread(system, engines=4) == 4.0  # every request carries it: all engines


def test_other_shared_prefixes_spread_after_min_count() -> None:
    hot = HotCandidates(window=100, min_count=8)
    shared = "Few-shot examples. " * 40

    def prompt(i: int) -> list[Anchor]:
        return candidate_anchors({"model": "m", "prompt": shared + f"Q{i}"})

    block = prompt(0)[0]
    assert block.kind is AnchorKind.block
    for i in range(7):
        hot.observe(prompt(i))
    assert not is_hot(hot, block, engines=4)
    hot.observe(prompt(7))
    assert hot.spread(block, engines=4) == 4.0


def test_a_conversation_alone_never_becomes_hot() -> None:
    # Its turns are nested, so nothing branches: it stays on its shortest anchor.
    hot = HotCandidates(window=100, min_count=2)
    for turns in range(1, 31):
        hot.observe(candidate_anchors(conv(0, turns)))
    assert all(hot.spread(a, 4) == 1.0 for a in candidate_anchors(conv(0, 31)))


@pytest.mark.parametrize(
    ("every", "engines", "spread"),
    [(20, 4, 1.0), (20, 8, 1.6), (10, 4, 1.6), (10, 2, 1.0), (4, 4, 4.0)],
)
def test_spread_follows_the_share(every: int, engines: int, spread: float) -> None:
    """divisor (4) x N x share, between 1 and N: template A carries 1/`every` of 200
    requests."""
    hot = HotCandidates(window=1000, min_count=2)
    for i in range(200):
        template = "A" if i % every == 0 else f"T{i}"
        hot.observe(candidate_anchors(chat({"role": "system", "content": template}, user(str(i)))))
    anchor = candidate_anchors(chat({"role": "system", "content": "A"}, user("x")))[0]
    assert hot.spread(anchor, engines) == pytest.approx(spread)


def test_window_decays_old_traffic() -> None:
    hot = HotCandidates(window=50, min_count=2)
    anchor = candidate_anchors(conv(0))[0]
    for i in range(50):
        hot.observe(candidate_anchors(conv(i)))
    assert is_hot(hot, anchor, 4)
    for i in range(100):  # two generations of traffic without that system prompt
        hot.observe(candidate_anchors(chat(user(f"plain {i}"))))
    assert not is_hot(hot, anchor, 4)


@pytest.mark.parametrize(
    "kwargs", [{"window": 0}, {"divisor": 0.0}, {"min_count": 0}, {"window": -1}]
)
def test_hot_window_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="positive"):
        HotCandidates(**kwargs)


def test_media_is_placed_by_path_not_by_count() -> None:
    """The walk also reports media where no content part holds it (a media key on a
    message, say); each part still gets its own digest, where counting would not."""
    body = chat(SYSTEM, user([image(), text("colour?")]))
    at = {"messages[1].content[0].image_url.url": "sha256:aa"}
    extra = {**body, "messages": [SYSTEM, {**body["messages"][1], "image_url": "x"}]}
    by_path = candidate_anchors(extra, {"messages[1].image_url": "sha256:zz", **at})
    assert by_path[1].kind is AnchorKind.media
    assert by_path[1].digest == candidate_anchors(body, at)[1].digest
    # Without the digest the part is keyed by its URL: a different anchor.
    assert candidate_anchors(body)[1].digest != by_path[1].digest


def test_a_segment_of_many_parts_is_hashed_without_holding_them_all() -> None:
    """A system message of 100,000 text parts of two characters (a 2.8 MB body; 650,000
    of them, 18.2 MB, are within the default `max_body_bytes` and `max_json_values`) is
    one segment: the leading system messages end at the first user message. Working
    out its anchors must not hold a copy of the segment, which the body budget does not
    charge: each part is fed to the hash and dropped. A memo of segments that kept every
    part until the cut held 4.6x the body at peak."""
    body = chat(
        {"role": "system", "content": [{"type": "text", "text": "ab"}] * 100_000},
        user("hi"),
    )
    raw = orjson.dumps(body)
    parsed = orjson.loads(raw)
    tracemalloc.start()
    try:
        candidate_anchors(parsed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= len(raw) // 16, (peak, len(raw))
