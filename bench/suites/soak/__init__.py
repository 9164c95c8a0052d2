"""Suite `soak`: legitimate traffic with and without abuse (slowloris, slow bodies,
oversized and decode-heavy media, bad JSON); see bench/suites/soak/suite.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.suites.fleet import RunConfig
    from bench.suites.report import Report


def run(cfg: RunConfig, report: Report) -> None:
    # Imported here: `python -m bench.suites.soak.abuse` must not find itself imported already.
    from bench.suites.soak.suite import run as run_suite

    run_suite(cfg, report)
