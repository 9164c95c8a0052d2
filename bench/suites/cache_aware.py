"""The cache-aware row (issue 30, goal 1): the gateway with its affinity policy and every
check on, against the cache-aware routers doing the same job.

Each proxy sits in front of the SAME two simulated engines and gets the same requests:
the first turns of 12 conversations of the routing suite's chat workload, one shared
system prompt (`bench/suites/routing/workloads.py`), sent in turn. The overhead suite
measures the added p50 and the CPU per request at 64 connections here, the instructions
suite the instructions per request; both grade the gateway against each router with
`goals`: no higher, small chat and stream alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from bench.suites.report import Report, fmt
from bench.suites.routing.workloads import build

CONVERSATIONS = 12
GATEWAY = "gateway affinity"
# The target name of each router in the row, and its policy.
ROUTERS = ("vllm-router cache_aware", "sglang-router cache_aware")
# Each case: whether it streams, and its max_tokens.
CASES = {"small chat": (False, 8), "16-token stream": (True, 16)}
GATEWAY_ENV = {"GATEWAY_ROUTING__POLICY": "affinity"}


def conversations(model: str, count: int = CONVERSATIONS) -> list[list[dict[str, Any]]]:
    """The messages of the first turn (the shared system prompt and a question) of the
    first `count` measured conversations of the routing suite's chat workload."""
    (chat,) = build(["chat"], model, scale=count / 48)
    return [session[0].body["messages"] for session in chat.measured[:count]]


def bodies(model: str, stream: bool, max_tokens: int) -> tuple[bytes, ...]:
    """One request body per conversation, in the order they are sent."""
    extra: dict[str, Any] = {"stream": True} if stream else {}
    return tuple(
        orjson.dumps({"model": model, "messages": m, "max_tokens": max_tokens, **extra})
        for m in conversations(model)
    )


def against_peer(
    report: Report,
    name: str,
    peer: str,
    gateway: float | None,
    other: float | None,
    unit: str = "us",
    scale: float = 1.0,
) -> None:
    """A goal that the gateway's figure is no more than `peer`'s, both measured in this
    run; figures are shown divided by `scale`, in `unit`."""

    def show(value: float) -> str:
        # Microseconds as measured; instructions in thousands, unit attached ("475K").
        return f"{fmt(value)} {unit}" if scale == 1 else f"{value / scale:,.0f}{unit}"

    measured = " vs ".join("n/a" if v is None else show(v) for v in (gateway, other))
    met = None if gateway is None or other is None else gateway <= other
    if other is None:
        detail = f"{peer} not measured"
    elif gateway is None or gateway <= other:
        detail = ""
    elif scale == 1:
        detail = f"by {gateway - other:.0f} {unit}"
    else:
        detail = f"by {show(gateway - other)}"
    report.goal(name, f"<= {peer}", measured, met, detail)


# How each figure of the row is shown: its unit and the divisor.
FIGURES: dict[str, tuple[str, float]] = {
    "added p50": ("us", 1.0),
    "CPU per request at 64 connections": ("us", 1.0),
    "instructions per request": ("K", 1000.0),
}


def goals(report: Report, figures: Mapping[str, Mapping[str, Mapping[str, float | None]]]) -> None:
    """Goal 1 of issue 30, per case, figure and router: the gateway (affinity) no higher.
    `figures[case][figure][target]`, with the figure names of FIGURES; a figure not in
    `figures` is not graded here (it belongs to the other suite)."""
    for case in CASES:
        for figure, values in figures.get(case, {}).items():
            unit, scale = FIGURES[figure]
            for router in ROUTERS:
                against_peer(
                    report,
                    f"issue 30 goal 1, {case}, 2 engines: {figure}, gateway (affinity) "
                    f"no more than {router}",
                    router,
                    values.get(GATEWAY),
                    values.get(router),
                    unit,
                    scale,
                )


# Issue 30, goal 2: the gateway's instructions per request, one engine, every check on.
GOAL_INSTRUCTIONS = {"small chat": 360_000.0, "16-token stream": 430_000.0}


def kilo(value: float) -> str:
    return f"{value / 1000:.0f}K"


def instruction_goals(report: Report, gateway: Mapping[str, float]) -> None:
    """Goal 2 of issue 30, from the instructions suite's one-engine counts."""
    for case, limit in GOAL_INSTRUCTIONS.items():
        value = gateway.get(case)
        report.bound(
            f"issue 30 goal 2, {case}, 1 engine: gateway instructions per request",
            f"<= {kilo(limit)}",
            "n/a" if value is None else kilo(value),
            value,
            limit,
            kilo,
        )
