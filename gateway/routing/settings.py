"""Settings of engine health checks and routing (`GATEWAY_ROUTING__...`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel


class RoutingPolicy(StrEnum):
    affinity = "affinity"
    round_robin = "round_robin"
    least_loaded = "least_loaded"


class RoutingSettings(BaseModel):
    policy: RoutingPolicy = RoutingPolicy.affinity
    health_interval: float = 2.0
    health_timeout: float = 1.0
    # Load bound for affinity: an engine is skipped while it carries more than
    # (1 + load_epsilon) * mean + 1 requests (DESIGN.md, "Routing key").
    load_epsilon: float = 0.75
