"""What the engines serve: the pool's index of their model lists (model_list.py).

The index is rebuilt by the pool whenever an engine's health or models change, never
per request: a request looks its model up in one dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from gateway.routing.engine import Engine


class ModelIndex:
    """The pool's models at one moment, from its engines (in configuration order) and
    `extra` (the `served_models` setting: names every engine serves without listing
    them, such as adapters a LoRA resolver loads on first use).

    - `served`: every model some engine lists, healthy or not (the engines of a model
      that are all down make it unavailable, not unknown), and `extra`;
    - `known`: some engine's models were read at least once;
    - `default`: the model a request without `model` runs, when every engine whose
      models are known has the same default; None when they differ (or none is known);
    - `engines(model)`: the healthy engines that serve `model`, in configuration order;
    - `line(model)`: every engine that serves `model`, healthy or not (by the models it
      last listed): the engines affinity lays its hot prompts over (policy.py), so an
      engine that fails its checks for a while moves only the requests it took.
    """

    __slots__ = ("_by_model", "_cards", "_lines", "_whole", "default", "known", "served")

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
        lines: dict[str, list[Engine]] = {}
        for engine in engines:
            for card in engine.listing.cards:
                lines.setdefault(card["id"], []).append(engine)
        for model in extra:
            lines[model] = list(engines)
        self._lines: dict[str, tuple[Engine, ...]] = {
            model: tuple(found) for model, found in lines.items()
        }
        self._cards = list(cards.values())
        self._whole = _render(self._cards)

    def engines(self, model: str) -> tuple[Engine, ...]:
        """The healthy engines serving `model` (empty: none is)."""
        return self._by_model.get(model, ())

    def line(self, model: str) -> tuple[Engine, ...]:
        """Every engine serving `model`, healthy or not, in configuration order."""
        return self._lines.get(model, ())

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
