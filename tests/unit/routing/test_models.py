"""The engines' model lists and the pool's index of them: tables of small cases, on the
pool's own Engine objects. Through running gateways: tests/e2e/test_model_pools.py."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.routing.engine import Engine
from gateway.routing.model_list import ModelList, parse_model_list
from gateway.routing.models import ModelIndex


def card(model: str, parent: str | None = None, root: str = "/srv/models/x") -> dict[str, Any]:
    """An entry as vLLM 0.32 lists it."""
    return {
        "id": model,
        "object": "model",
        "created": 1700000000,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": 4096 if parent is None else None,
        "permission": [],
    }


def listing(*cards: dict[str, Any]) -> bytes:
    return orjson.dumps({"object": "list", "data": list(cards)})


def engine(port: int, *cards: dict[str, Any], healthy: bool = True, listed: bool = True) -> Engine:
    e = Engine(f"http://127.0.0.1:{port}")
    if listed:
        parsed = parse_model_list(listing(*cards))
        assert parsed is not None
        e.listing, e.models_at, e.healthy = parsed, 1.0, healthy
    return e


# --- reading an engine's list --------------------------------------------------------------


def test_a_vllm_list_is_read_with_its_default_and_without_paths() -> None:
    body = listing(
        card("llama", root="/srv/models/llama"),
        card("llama-alias", root="/srv/models/llama"),
        card("sql-lora", parent="llama", root="/srv/adapters/sql"),
    )
    parsed = parse_model_list(body)
    assert parsed is not None
    assert parsed.ids == {"llama", "llama-alias", "sql-lora"}
    # The first served name is what vLLM runs for a request without `model`.
    assert parsed.default == "llama"
    assert [c["root"] for c in parsed.cards] == ["llama", "llama-alias", "sql-lora"]
    assert b"/srv/" not in orjson.dumps(parsed.cards)


@pytest.mark.parametrize(
    "body",
    [b"", b"nope", b"[]", b'{"data": "nope"}', b'{"data": {"id": "x"}}', b'{"object": "list"}'],
)
def test_what_is_not_a_model_list_is_not_read(body: bytes) -> None:
    assert parse_model_list(body) is None


def test_entries_without_a_usable_id_are_left_out() -> None:
    body = orjson.dumps(
        {"data": [1, "x", {"id": 3}, {"id": ""}, {"object": "model"}, card("m"), card("m")]}
    )
    parsed = parse_model_list(body)
    assert parsed is not None
    assert parsed.ids == {"m"} and len(parsed.cards) == 1 and parsed.default == "m"


def test_an_engine_listing_nothing_serves_nothing() -> None:
    assert parse_model_list(listing()) == ModelList()


# --- the index ---------------------------------------------------------------------------


def test_requests_go_to_the_healthy_engines_of_their_model_in_order() -> None:
    a = engine(1, card("chat"))
    b = engine(2, card("chat"), card("chat-lora", parent="chat"))
    down = engine(3, card("chat"), healthy=False)
    emb = engine(4, card("embed"))
    index = ModelIndex([a, b, down, emb])
    assert index.engines("chat") == (a, b)
    assert index.engines("chat-lora") == (b,)
    assert index.engines("embed") == (emb,)
    assert index.engines("nothing") == ()
    assert index.served == {"chat", "chat-lora", "embed"}


def test_a_model_whose_engines_are_down_is_served_but_unavailable() -> None:
    index = ModelIndex([engine(1, card("chat")), engine(2, card("embed"), healthy=False)])
    assert "embed" in index.served and index.engines("embed") == ()


def test_configured_models_are_served_by_every_healthy_engine() -> None:
    a, b = engine(1, card("chat")), engine(2, card("embed"))
    down = engine(3, card("chat"), healthy=False)
    index = ModelIndex([a, b, down], frozenset({"resolved-lora", "chat"}))
    assert index.engines("resolved-lora") == index.engines("chat") == (a, b)
    assert "resolved-lora" in index.served
    # Not listed by any engine: the gateway has no entry to show for it.
    assert b"resolved-lora" not in index.listing(None)


def test_nothing_is_known_before_an_engine_lists_its_models() -> None:
    index = ModelIndex([engine(1, listed=False)], frozenset({"x"}))
    assert not index.known and index.default is None and index.engines("x") == ()


@pytest.mark.parametrize(
    ("engines", "default"),
    [
        # One model everywhere; adapters and aliases beside it change nothing.
        ([[card("m")], [card("m"), card("lora", parent="m")]], "m"),
        ([[card("m"), card("alias")], [card("m")]], "m"),
        # Different first names: different defaults, even for the same weights.
        ([[card("alias"), card("m")], [card("m")]], None),
        ([[card("chat")], [card("embed")]], None),
        # An engine that lists nothing has no default: the others' is not everyone's.
        ([[card("m")], []], None),
    ],
)
def test_the_default_model_is_everyones_or_none(
    engines: list[list[dict[str, Any]]], default: str | None
) -> None:
    index = ModelIndex([engine(i, *cards) for i, cards in enumerate(engines)])
    assert index.default == default


def test_an_engine_that_is_down_still_counts_for_the_default() -> None:
    # What a request without `model` means must not change with the engines' health.
    index = ModelIndex([engine(1, card("chat")), engine(2, card("embed"), healthy=False)])
    assert index.default is None
    # An engine never read (never healthy) is not known to have a default at all.
    index = ModelIndex([engine(1, card("chat")), engine(2, listed=False)])
    assert index.default == "chat"


# --- the merged list ------------------------------------------------------------------------


def ids_and_parents(body: bytes) -> list[tuple[str, str | None]]:
    answer = orjson.loads(body)
    assert answer["object"] == "list"
    return [(m["id"], m["parent"]) for m in answer["data"]]


def test_the_list_names_each_model_once_from_the_first_engine_listing_it() -> None:
    first = engine(1, {**card("chat"), "max_model_len": 111})
    second = engine(2, {**card("chat"), "max_model_len": 222}, card("lora", parent="chat"))
    down = engine(3, card("gone"), healthy=False)
    index = ModelIndex([first, second, down, engine(4, card("embed"))])
    body = index.listing(None)
    assert ids_and_parents(body) == [("chat", None), ("lora", "chat"), ("embed", None)]
    assert orjson.loads(body)["data"][0]["max_model_len"] == 111
    assert b"/srv/" not in body


@pytest.mark.parametrize(
    ("allowed", "expected"),
    [
        (frozenset({"chat", "lora"}), [("chat", None), ("lora", "chat")]),
        # The adapter's base model is not the key's: it is not named.
        (frozenset({"lora"}), [("lora", None)]),
        (frozenset({"embed", "not-served"}), [("embed", None)]),
        (frozenset(), []),
    ],
)
def test_a_key_limited_to_some_models_sees_only_those(
    allowed: frozenset[str], expected: list[tuple[str, str | None]]
) -> None:
    index = ModelIndex(
        [engine(1, card("chat"), card("lora", parent="chat")), engine(2, card("embed"))]
    )
    assert ids_and_parents(index.listing(allowed)) == expected
