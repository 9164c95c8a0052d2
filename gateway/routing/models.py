"""What the engines serve: each engine's model list, and the pool's index of them.

vLLM 0.32's `GET /v1/models` lists the engine's base model once per served name
(`--served-model-name`; the first is what a request without `model` runs), then every
loaded LoRA adapter, with the name of its base model as `parent`. `root` holds a path on
the engine's disk (the model's or the adapter's): it is replaced by the id as the list
is read, so nothing the gateway keeps or answers carries it. (vLLM 0.32 serves no
`GET /v1/models/{id}`; neither does the gateway.)

The index is rebuilt by the pool whenever an engine's health or models change, never
per request: a request looks its model up in one dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from gateway.routing.pool import Engine


@dataclass(frozen=True, slots=True)
class ModelList:
    """One engine's models as last read: its cards (vLLM's entries, `root` replaced by
    the id) in the engine's order, their ids, and its default model (the first entry
    without a `parent`: what vLLM runs for a request that names none)."""

    cards: tuple[dict[str, Any], ...] = ()
    ids: frozenset[str] = field(default_factory=frozenset)
    default: str | None = None


def parse_model_list(body: bytes) -> ModelList | None:
    """An engine's `/v1/models` answer; None when it is not a model list (the engine's
    models then stay unknown). Entries without a string `id`, or whose `parent` is
    neither a name nor null, are left out."""
    try:
        listing: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    cards: list[dict[str, Any]] = []
    seen: set[str] = set()
    default: str | None = None
    for entry in data:
        if not isinstance(entry, dict):
            continue
        model = entry.get("id")
        if not isinstance(model, str) or not model or model in seen:
            continue
        if not isinstance(entry.get("parent"), str | None):
            continue  # not vLLM's shape: `_render` looks its parent up among the ids
        seen.add(model)
        cards.append({**entry, "root": model} if "root" in entry else entry)
        if default is None and entry.get("parent") is None:
            default = model
    return ModelList(tuple(cards), frozenset(seen), default)


class ModelIndex:
    """The pool's models at one moment, from its engines (in configuration order) and
    `extra` (the `served_models` setting: names every engine serves without listing
    them, such as adapters a LoRA resolver loads on first use).

    - `served`: every model some engine lists, healthy or not (the engines of a model
      that are all down make it unavailable, not unknown), and `extra`;
    - `known`: some engine's models were read at least once;
    - `default`: the model a request without `model` runs, when every engine whose
      models are known has the same default; None when they differ (or none is known);
    - `engines(model)`: the healthy engines that serve `model`, in configuration order.
    """

    __slots__ = ("_by_model", "_cards", "_whole", "default", "known", "served")

    def __init__(self, engines: Sequence[Engine], extra: frozenset[str] = frozenset()) -> None:
        listed = [e for e in engines if e.models_at > 0]
        self.known = bool(listed)
        self.served: frozenset[str] = extra.union(*(e.listing.ids for e in engines))
        defaults = {e.listing.default for e in listed}
        self.default: str | None = defaults.pop() if len(defaults) == 1 else None
        healthy = [e for e in engines if e.healthy]
        by_model: dict[str, list[Engine]] = {}
        cards: dict[str, dict[str, Any]] = {}
        for engine in healthy:
            for card in engine.listing.cards:
                cards.setdefault(card["id"], card)
                by_model.setdefault(card["id"], []).append(engine)
        for model in extra:
            # Served by every engine: a model both listed and configured goes to all.
            by_model[model] = list(healthy)
        self._by_model: dict[str, tuple[Engine, ...]] = {
            model: tuple(found) for model, found in by_model.items()
        }
        self._cards = list(cards.values())
        self._whole = _render(self._cards)

    def engines(self, model: str) -> tuple[Engine, ...]:
        """The healthy engines serving `model` (empty: none is)."""
        return self._by_model.get(model, ())

    def listing(self, allowed: frozenset[str] | None) -> bytes:
        """The `/v1/models` answer: the healthy engines' models, each once (the entry of
        the first engine in configuration order that lists it), and for a key limited
        to some models (`allowed`) only those, so a key learns nothing of the models it
        may not use."""
        if allowed is None:
            return self._whole
        return _render([c for c in self._cards if c["id"] in allowed])


def _render(cards: Iterable[dict[str, Any]]) -> bytes:
    """The list as vLLM shapes it; an adapter's `parent` (its base model) shown only
    when the base model is in the same answer."""
    kept = list(cards)
    ids = {c["id"] for c in kept}
    data = [
        c if c.get("parent") is None or c["parent"] in ids else {**c, "parent": None} for c in kept
    ]
    return orjson.dumps({"object": "list", "data": data})
