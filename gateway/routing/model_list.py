"""One engine's model list: vLLM's `GET /v1/models` answer, read.

vLLM 0.32's `GET /v1/models` lists the engine's base model once per served name
(`--served-model-name`; the first is what a request without `model` runs), then every
loaded LoRA adapter, with the name of its base model as `parent`. `root` holds a path on
the engine's disk (the model's or the adapter's): it is replaced by the id as the list
is read, so nothing the gateway keeps or answers carries it. (vLLM 0.32 serves no
`GET /v1/models/{id}`; neither does the gateway.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


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
