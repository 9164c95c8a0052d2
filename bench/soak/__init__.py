"""Suite `soak`: legitimate traffic with and without abuse (slowloris, slow bodies,
oversized and decode-heavy media, bad JSON); see bench/soak/suite.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.report import Report
    from bench.stack import RunConfig


def run(cfg: RunConfig, report: Report) -> None:
    # Imported here: `python -m bench.soak.abuse` must not find itself imported already.
    from bench.soak.suite import run as run_suite

    run_suite(cfg, report)
