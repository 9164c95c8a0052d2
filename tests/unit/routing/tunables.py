"""`candidate_anchors` and `HotCandidates` with the routing settings' defaults, as the
affinity policy calls them under a default configuration."""

from collections.abc import Mapping
from typing import Any

from gateway.routing import anchors, hotspots
from gateway.routing.settings import RoutingSettings

ROUTING = RoutingSettings()


def candidate_anchors(
    body: dict[str, Any] | None,
    media: Mapping[str, str] | None = None,
    *,
    block_bytes: int = ROUTING.prompt_block_bytes,
    max_candidates: int = ROUTING.max_candidates,
) -> list[anchors.Anchor]:
    return anchors.candidate_anchors(
        body, media, block_bytes=block_bytes, max_candidates=max_candidates
    )


class HotCandidates(hotspots.HotCandidates):
    def __init__(
        self,
        *,
        window: int = ROUTING.hot_window,
        divisor: float = ROUTING.hot_divisor,
        min_count: int = ROUTING.hot_min_count,
    ) -> None:
        super().__init__(window=window, divisor=divisor, min_count=min_count)
