"""What a run leaves behind: raw JSON, a Markdown report and PNG plots in one folder.

`bench/results/<timestamp>-<suite>/` (or the folder given to `--out`) holds
`results.json` (every measurement, raw samples summarised), `report.md` (tables, goals
met or missed by how much, the plots) and the PNGs. The summary printed at the end of a
run is the report's tables.

A smoke run (`--quick`: tiny sizes that check that a suite works) says so at the top of
its report, in the summary and in the title of every plot, and grades no goal: the
report shows each goal's target and figure with "not graded: smoke run". results.json
keeps what the check said (`met`) beside `graded: false`, for the tests of the suites.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"

SMOKE = "smoke run: not a measurement"
NOT_GRADED = "not graded: smoke run"

_T0 = time.monotonic()


def progress(message: str) -> None:
    """One line of progress on stderr, with the seconds since the run started."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, percentiles and the range of `values` (empty dict for none)."""
    if not values:
        return {}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]

    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p25": pct(25),
        "p75": pct(75),
        "p99": pct(99),
        "min": ordered[0],
        "max": ordered[-1],
    }


def paired_ratios(values: Sequence[float], baseline: Sequence[float]) -> dict[str, float]:
    """Ratios of interleaved repeats (value[i] / baseline[i]): median and range."""
    ratios = [v / b for v, b in zip(values, baseline, strict=False) if b]
    if not ratios:
        return {}
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        # Ratios sit near 1: one decimal would hide the differences that matter.
        return f"{value:.{max(digits, 2) if abs(value) < 10 else digits}f}"
    return str(value)


@dataclass
class Goal:
    name: str
    target: str
    measured: str
    met: bool | None  # None: could not be checked in this run
    detail: str = ""
    graded: bool = True  # False on a smoke run: no verdict is shown

    @property
    def verdict(self) -> str:
        if not self.graded:
            return NOT_GRADED
        verdict = {True: "met", False: "missed", None: "not checked"}[self.met]
        return f"{verdict} ({self.detail})" if self.detail else verdict


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel reports it; the platform's processor name
    where there is no /proc/cpuinfo, "unknown" where neither says."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or "unknown"


@dataclass
class Report:
    """One suite's results. Call `write()` once at the end."""

    suite: str
    out_dir: Path
    meta: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    smoke: bool = False
    # The titles of each plot's axes, as drawn.
    plot_titles: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def create(cls, suite: str, out_dir: Path | None = None, *, smoke: bool = False) -> Report:
        if out_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out_dir = RESULTS / f"{stamp}-{suite}"
        out_dir.mkdir(parents=True, exist_ok=True)
        load = os.getloadavg()
        meta = {
            "suite": suite,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            # The machine's CPUs; the bench process itself is pinned (see "pinning").
            "cpus": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in load],
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            # Which CPU: figures of two machines of one kind differ by it (docs/routing.md,
            # "Six runs a side on an EPYC without AMX").
            "cpu_model": cpu_model(),
        }
        return cls(suite, out_dir, meta, smoke=smoke)

    def table(self, title: str, columns: list[str], rows: list[list[Any]], note: str = "") -> None:
        self.tables.append(Table(title, columns, [[fmt(c) for c in r] for r in rows], note))

    def goal(
        self, name: str, target: str, measured: str, met: bool | None, detail: str = ""
    ) -> None:
        self.goals.append(Goal(name, target, measured, met, detail, graded=not self.smoke))

    def bound(
        self,
        name: str,
        target: str,
        measured: str,
        value: float | None,
        limit: float,
        gap: Callable[[float], str],
        *,
        at_most: bool = True,
        also: str = "",
    ) -> None:
        """A goal that `value` stays at most (or at least) `limit`; a miss says by how
        much, as `gap(distance)`, and either verdict adds `also`. No value: not
        measured."""
        if value is None:
            self.goal(name, target, measured, None)
            return
        met = value <= limit if at_most else value >= limit
        details = ([] if met else [f"by {gap(abs(value - limit))}"]) + ([also] if also else [])
        self.goal(name, target, measured, met, ", ".join(details))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def plot(
        self,
        name: str,
        draw: Callable[[Any], None],
        size: tuple[float, float] = (7, 4),
        rows: int = 1,
    ) -> None:
        """Draw with `draw(ax)` on a fresh figure and save it as `<name>.png`; with
        `rows` above 1, `draw` gets that many axes, one above the other. On a smoke run
        every axes' title starts with "smoke run: not a measurement"."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(rows, 1, figsize=size)
        try:
            draw(ax)
            for each in fig.axes:
                if self.smoke:
                    title = each.get_title()
                    # set_text keeps the title's padding and font, set by `draw`.
                    each.title.set_text(f"{SMOKE}: {title}" if title else SMOKE)
            self.plot_titles[f"{name}.png"] = [each.get_title() for each in fig.axes]
            fig.tight_layout()
            fig.savefig(self.out_dir / f"{name}.png", dpi=100)
        finally:
            plt.close(fig)
        self.plots.append(f"{name}.png")

    def markdown(self) -> str:
        lines = [f"# bench: {self.suite}", ""]
        if self.smoke:
            lines += [
                f"**{SMOKE}.** `--quick` runs tiny sizes on whatever else the machine is "
                "doing: it checks that the suite works. No goal is graded; the figures are "
                "not the gateway's cost.",
                "",
            ]
        lines += [f"- {k}: {v}" for k, v in self.meta.items()]
        lines.append("")
        if self.goals:
            lines += ["## Goals", "", "| goal | target | measured | verdict |", "|---|---|---|---|"]
            for g in self.goals:
                lines.append(f"| {g.name} | {g.target} | {g.measured} | {g.verdict} |")
            lines.append("")
        for t in self.tables:
            lines += [f"## {t.title}", ""]
            lines.append("| " + " | ".join(t.columns) + " |")
            lines.append("|" + "---|" * len(t.columns))
            lines += ["| " + " | ".join(r) + " |" for r in t.rows]
            if t.note:
                lines += ["", t.note]
            lines.append("")
        if self.notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        if self.plots:
            lines += ["## Plots", ""] + [f"![{p}]({p})" for p in self.plots] + [""]
        return "\n".join(lines)

    def summary(self) -> str:
        """Plain-text tables for the terminal."""
        out: list[str] = [SMOKE] if self.smoke else []
        for t in self.tables:
            widths = [
                max(len(str(x)) for x in [c, *[r[i] for r in t.rows]])
                for i, c in enumerate(t.columns)
            ]
            out.append(f"\n{t.title}")
            out.append("  ".join(c.ljust(w) for c, w in zip(t.columns, widths, strict=True)))
            for r in t.rows:
                out.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)))
        if self.goals:
            out.append("\nGoals")
            for g in self.goals:
                verdict = {True: "MET", False: "MISSED", None: "not checked"}[g.met]
                verdict = verdict if g.graded else NOT_GRADED
                out.append(f"  {verdict:11} {g.name}: {g.measured} (target {g.target}) {g.detail}")
        for n in self.notes:
            out.append(f"note: {n}")
        out.append(f"\nreport: {self.out_dir / 'report.md'}")
        return "\n".join(out)

    def write(self) -> Path:
        self.meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
        self.meta["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        data = {
            "meta": self.meta,
            "smoke": self.smoke,
            "goals": [asdict(g) for g in self.goals],
            "tables": [asdict(t) for t in self.tables],
            "notes": self.notes,
            "plots": self.plots,
            "plot_titles": self.plot_titles,
            "raw": self.raw,
        }
        (self.out_dir / "results.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out_dir / "report.md").write_text(self.markdown())
        return self.out_dir
