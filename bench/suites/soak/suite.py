"""Suite `soak`: legitimate traffic alone, then the same traffic under abuse.

A simulated engine and the gateway with its default settings (only the keys set) on
loopback. Timeline, as shares of `--duration`: warm-up 10%,
baseline 35% (legitimate traffic alone), abuse 35% (the same traffic and every kind of
abuse at once, from a separate process: bench/suites/soak/abuse.py), recovery 20% (the traffic
alone again). The gateway's RSS, open descriptors and CPU time are sampled every second
throughout.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness.server import ROOT, terminate
from bench.suites.fleet import Fleet, RunConfig, discover_model
from bench.suites.loadgen import percentile
from bench.suites.report import Report, progress
from bench.suites.soak.abuse import HEAVY, AbuseConfig
from bench.suites.soak.legit import LegitTraffic, Outcome
from bench.suites.soak.sampler import ProcessSampler, Sample

DURATION = 600.0
# The smoke run: phases of 2, 7, 7 and 4 s, each still sampled for more than a 5 s window
# where it needs one; tests/bench/test_soak.py runs it (30 s before: 10 s of waiting).
QUICK_DURATION = 20.0
# Phases as shares of the duration (their order is the run's).
PHASES = (("warm-up", 0.10), ("baseline", 0.35), ("abuse", 0.35), ("recovery", 0.20))
RATE = 20.0  # legitimate requests a second, open loop
LEGIT_KEYS = {
    "tenant-a": "soak-tenant-a-key-0123456789",
    "tenant-b": "soak-tenant-b-key-0123456789",
}
# Abuse keys by role (abuse.AbuseConfig.keys); slowloris and idle connections have none.
ABUSE_KEYS = {
    "slow": "soak-abuser-slow-key-0123456789",
    "media": "soak-abuser-media-key-0123456789",
    "misc": "soak-abuser-misc-key-0123456789",
}

# What "flat" means (see bench/README.md, "soak").
ERROR_RATE_MARGIN = 0.01  # abuse-phase error rate at most baseline's + 1 point
P99_RATIO_MAX = 2.0  # abuse-phase p99 at most twice baseline's
RSS_ABUSE_GROWTH_MAX = 0.2  # end of abuse at most 20% above its middle
RSS_RETAINED_MAX = 0.25  # after the abuse at most 25% above the end of the baseline
RSS_PEAK_MAX = 512 * 2**20  # the bound for the decode-heavy requests
FD_SLACK = 8  # at rest after the run, at most the count at rest before it + this
# Seconds of sampling after the last legitimate request, all clients closed: longer than
# uvicorn's keep-alive (5 s) and the gateway's engine keep-alive (4 s), so the count of
# descriptors at rest is comparable with the one before the traffic.
SETTLE = 6.0
WINDOW = 5.0  # seconds of samples a level is the median of
# The memory-heavy abuse (abuse.HEAVY) stops when the gateway's RSS passes this (or a
# quarter of the memory available at the start, if less), all abuse at 1.5 times it:
# the gateway of 2026-11-30 grew by ~200 MiB/s under the decode-heavy requests without
# levelling off (5.8 GiB after 24 s), which would take a shared machine down.
RSS_CEILING = 3 * 2**30


def rss_ceiling() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(RSS_CEILING, int(line.split()[1]) * 1024 // 4)
    except OSError:
        pass
    return RSS_CEILING


@dataclass(frozen=True)
class Timeline:
    """Phase boundaries in seconds since the start of traffic."""

    bounds: tuple[tuple[str, float, float], ...]

    @classmethod
    def of(cls, duration: float) -> Timeline:
        out, at = [], 0.0
        for name, share in PHASES:
            out.append((name, at, at + duration * share))
            at += duration * share
        return cls(tuple(out))

    def phase_at(self, t: float) -> str:
        for name, start, end in self.bounds:
            if start <= t < end:
                return name
        return self.bounds[-1][0]

    def span(self, name: str) -> tuple[float, float]:
        for phase, start, end in self.bounds:
            if phase == name:
                return start, end
        raise KeyError(name)

    @property
    def end(self) -> float:
        return self.bounds[-1][2]


def gateway_defaults() -> dict[str, int]:
    """The gateway's own defaults for what the abuse is sized by (read, not copied, so
    a branch that changes them is soaked at its own values)."""
    from gateway.config.settings import LimitsSettings
    from gateway.media.settings import MediaSettings

    limits, media = LimitsSettings(), MediaSettings()
    return {
        "max_in_flight": limits.max_in_flight,
        "max_body_bytes": limits.max_body_bytes,
        "media_max_bytes": media.max_bytes,
        "max_pixels": media.max_pixels,
    }


def pinned_defaults() -> dict[str, str]:
    """Environment that sets every number and flag of the gateway's `limits`, `timeouts`
    and `media` sections to its default. The bench's gateways may carry bench-wide
    overrides (bench/suites/fleet.py's Fleet.gateway); the soak runs the defaults, whatever
    settings the branch has."""
    from pydantic import BaseModel

    from gateway.config.settings import Settings

    env: dict[str, str] = {}
    for section in ("limits", "timeouts", "media"):
        model = Settings.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for name, value in model().model_dump(mode="json").items():
            if isinstance(value, bool | int | float):
                env[f"GATEWAY_{section.upper()}__{name.upper()}"] = json.dumps(value)
    return env


class AbuseProcess:
    """bench/suites/soak/abuse.py in a child process (same process group as this one)."""

    def __init__(self, cfg: AbuseConfig, workdir: Path) -> None:
        path = workdir / "abuse.json"
        path.write_text(json.dumps(asdict(cfg)))
        self.log = workdir / "abuse.log"
        with self.log.open("wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "bench.suites.soak.abuse", str(path)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )

    def _line(self, timeout: float) -> str:
        assert self.popen.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.popen.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RuntimeError(f"the abuse process said nothing in {timeout:.0f} s")
        return self.popen.stdout.readline().decode()

    def wait_ready(self, timeout: float = 60.0) -> None:
        if self._line(timeout).strip() != "ready":
            raise RuntimeError(f"the abuse process failed:\n{self.log.read_text()[-3000:]}")

    def go(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(b"go\n")
        self.popen.stdin.flush()
        self.went = time.monotonic()

    went: float | None = None

    def interrupt(self, sig: signal.Signals) -> bool:
        """SIGUSR1: stop the abuse that costs memory; SIGUSR2: stop all of it. Sent only
        once the abuse runs (before, the signal would kill the process)."""
        if self.went is None or time.monotonic() - self.went < 1.0:
            return False
        if self.popen.poll() is not None:
            return False
        os.kill(self.popen.pid, sig)
        return True

    def result(self, timeout: float) -> dict[str, Any]:
        line = self._line(timeout)
        if not line.strip():
            raise RuntimeError(f"the abuse process failed:\n{self.log.read_text()[-3000:]}")
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        terminate(self.popen)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                pipe.close()


def run(cfg: RunConfig, report: Report) -> None:
    if cfg.external:
        raise SystemExit("soak starts its own gateway (it samples the gateway's process)")
    duration = cfg.duration or (QUICK_DURATION if cfg.quick else DURATION)
    timeline = Timeline.of(duration)
    defaults = gateway_defaults()
    timeout = 10.0 if duration <= 60 else 30.0
    report.meta["pinning"] = cfg.cpus.describe()
    report.meta["duration_s"] = duration
    report.meta["phases_s"] = {n: [round(a, 1), round(b, 1)] for n, a, b in timeline.bounds}
    report.meta["legit_rate_per_s"] = RATE
    report.meta["gateway_defaults"] = defaults
    report.meta["gateway_settings"] = (
        "defaults: every number and flag of limits, timeouts and media set to its default "
        "(over any bench-wide override); client keys tenant-a, tenant-b, abuser-slow, "
        "abuser-media, abuser-misc"
    )

    abusers = {f"abuser-{role}": key for role, key in ABUSE_KEYS.items()}
    keys = [{"key": k, "name": n} for n, k in [*LEGIT_KEYS.items(), *abusers.items()]]
    with Fleet(cfg.workdir, cfg.cpus) as fleet:
        progress("starting a simulated engine and the gateway")
        sim = fleet.sim(name="sim")
        model = cfg.model or discover_model(cfg.direct_target(sim.url))
        env = {**pinned_defaults(), "GATEWAY_API_KEYS": json.dumps(keys)}
        gw = fleet.gateway([sim.url], env=env)
        assert gw.pid is not None
        abuse_start, abuse_end = timeline.span("abuse")
        abuse_cfg = AbuseConfig(
            host="127.0.0.1",
            port=gw.port,
            keys=ABUSE_KEYS,
            model=model,
            duration=abuse_end - abuse_start,
            answer_timeout=timeout,
            max_in_flight=defaults["max_in_flight"],
            max_body_bytes=defaults["max_body_bytes"],
            media_max_bytes=defaults["media_max_bytes"],
            max_pixels=defaults["max_pixels"],
        )
        progress("abuse process: building its payloads")
        abuser = AbuseProcess(abuse_cfg, cfg.workdir)
        try:
            abuser.wait_ready()
            legit = LegitTraffic(gw.url, LEGIT_KEYS, model, RATE, timeout)
            progress(
                f"traffic for {duration:.0f} s: "
                + ", ".join(f"{n} {b - a:.0f} s" for n, a, b in timeline.bounds)
            )
            t0 = time.monotonic()
            ceiling = rss_ceiling()
            report.meta["rss_ceiling_bytes"] = ceiling
            guard: dict[str, float] = {}

            def watch(sample: Sample) -> None:
                for name, limit, sig in (
                    ("heavy", ceiling, signal.SIGUSR1),
                    ("all", 1.5 * ceiling, signal.SIGUSR2),
                ):
                    if sample.rss > limit and name not in guard and abuser.interrupt(sig):
                        guard[name] = sample.t
                        progress(f"gateway RSS {sample.rss / 2**20:.0f} MiB: {name} abuse stopped")

            with ProcessSampler(gw.pid, t0, watch=watch) as sampler:
                _drive(legit, abuser, timeline, t0)
                progress(f"traffic done; {SETTLE:g} s at rest")
                time.sleep(SETTLE)
            abuse = abuser.result(timeout=30.0)
        finally:
            abuser.stop()
        gateway_alive = gw.alive()
    abuse["guard"] = guard
    if "heavy" in guard:
        report.note(
            f"safety ceiling: at {guard['heavy']:.0f} s the gateway's RSS passed "
            f"{ceiling / 2**20:.0f} MiB and the abuse that costs memory ("
            + ", ".join(HEAVY)
            + ") stopped; the rest went on"
        )
    if "all" in guard:
        report.note(
            f"safety ceiling: at {guard['all']:.0f} s the gateway's RSS passed "
            f"{1.5 * ceiling / 2**20:.0f} MiB and all abuse stopped"
        )
    summarise(report, timeline, legit.outcomes, abuse, sampler.samples, gateway_alive)


def _drive(legit: LegitTraffic, abuser: AbuseProcess, timeline: Timeline, t0: float) -> None:
    """The legitimate traffic for the whole timeline; the abuse process told to start at
    the abuse phase (it stops by itself at its end)."""

    async def abuse_on_time() -> None:
        start, end = timeline.span("abuse")
        await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
        progress("abuse phase: the abuse process starts")
        abuser.go()
        await asyncio.sleep(max(0.0, t0 + end - time.monotonic()))
        progress("recovery phase: abuse stopped")

    async def both() -> None:
        await asyncio.gather(legit.run(t0, timeline.end, timeline.phase_at), abuse_on_time())

    asyncio.run(both())


# --- the report ---------------------------------------------------------------------------


def legit_stats(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    ok = sorted(o.latency for o in outcomes if o.ok and o.latency is not None)
    ends = Counter(
        o.error if o.status is None else f"{o.status} {o.error or ''}".strip() for o in outcomes
    )
    errors = sum(1 for o in outcomes if not o.ok)
    return {
        "sent": len(outcomes),
        "errors": errors,
        "error_rate": errors / len(outcomes) if outcomes else None,
        "p50_ms": percentile(ok, 50) * 1000 if ok else None,
        "p99_ms": percentile(ok, 99) * 1000 if ok else None,
        "ends": dict(ends.most_common()),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _level(samples: Sequence[Sample], start: float, end: float, attr: str) -> float | None:
    values = [getattr(s, attr) for s in samples if start <= s.t < end]
    return float(statistics.median(values)) if values else None


def resources(samples: Sequence[Sample], timeline: Timeline) -> dict[str, Any]:
    """The figures the flat verdicts are made of (bytes, counts)."""
    base_start, base_end = timeline.span("baseline")
    abuse_start, abuse_end = timeline.span("abuse")
    last = samples[-1].t if samples else 0.0
    after = [s for s in samples if s.t >= abuse_end]
    return {
        # Median of the first WINDOW seconds of the baseline: warmed up, not yet abused.
        "rss_after_warmup": _level(samples, base_start, base_start + WINDOW, "rss"),
        "rss_end_of_baseline": _level(samples, base_end - WINDOW, base_end, "rss"),
        # The middle of the abuse: the level its defences hold it at, to compare its end with.
        "rss_mid_abuse": _level(
            samples,
            (abuse_start + abuse_end - WINDOW) / 2,
            (abuse_start + abuse_end + WINDOW) / 2,
            "rss",
        ),
        "rss_end_of_abuse": _level(samples, abuse_end - WINDOW, abuse_end, "rss"),
        # At rest: the first sample (before any traffic) and the last three.
        "rss_at_rest_after": _level(samples, last - 2.5, last + 1, "rss"),
        "rss_peak": max((s.rss for s in samples), default=None),
        "rss_peak_abuse": max(
            (s.rss for s in samples if abuse_start <= s.t < abuse_end), default=None
        ),
        "fds_at_rest_before": samples[0].fds if samples else None,
        "fds_baseline_max": max(
            (s.fds for s in samples if base_start <= s.t < base_end), default=None
        ),
        "fds_abuse_max": max(
            (s.fds for s in samples if abuse_start <= s.t < abuse_end), default=None
        ),
        "fds_at_rest_after": _level(samples, last - 2.5, last + 1, "fds"),
        "samples_after_abuse": len(after),
    }


def summarise(
    report: Report,
    timeline: Timeline,
    outcomes: Sequence[Outcome],
    abuse: dict[str, Any],
    samples: Sequence[Sample],
    gateway_alive: bool,
) -> None:
    phases = [n for n, _, _ in timeline.bounds if n != "warm-up"]
    by_phase = {p: legit_stats([o for o in outcomes if o.phase == p]) for p in phases}
    base = by_phase["baseline"]
    rows = []
    for p in phases:
        s = by_phase[p]
        rows.append(
            [
                p,
                s["sent"],
                s["errors"],
                None if s["error_rate"] is None else f"{s['error_rate']:.1%}",
                s["p50_ms"],
                s["p99_ms"],
                _ratio(s["p50_ms"], base["p50_ms"]),
                _ratio(s["p99_ms"], base["p99_ms"]),
                ", ".join(f"{k}: {v}" for k, v in s["ends"].items()),
            ]
        )
    report.table(
        "Legitimate requests by phase",
        [
            "phase",
            "sent",
            "errors",
            "error rate",
            "p50 ms",
            "p99 ms",
            "p50 / baseline",
            "p99 / baseline",
            "how they ended",
        ],
        rows,
        f"Open loop at {RATE:g} requests/s from two keys (4 chat, 2 streaming chat, "
        "2 completions, 2 chat with a new 64x64 PNG in every 10). Latency from the scheduled "
        "start to the last byte, successful requests only; an error is any status other "
        "than 2xx, a timeout, a connection error or a stream cut short.",
    )
    kinds = sorted({o.kind for o in outcomes})
    by_kind: dict[str, dict[str, Any]] = {}
    krows = []
    for k in kinds:
        by_kind[k] = {}
        for p in ("baseline", "abuse"):
            s = legit_stats([o for o in outcomes if o.kind == k and o.phase == p])
            by_kind[k][p] = s
            krows.append(
                [
                    k,
                    p,
                    s["sent"],
                    None if s["error_rate"] is None else f"{s['error_rate']:.1%}",
                    s["p50_ms"],
                    s["p99_ms"],
                ]
            )
    report.table(
        "Legitimate requests by kind",
        ["kind", "phase", "sent", "error rate", "p50 ms", "p99 ms"],
        krows,
    )

    arows = []
    for kind, t in abuse["kinds"].items():
        ended = t["ended_after_s"]
        share = t["gateway_ended"] / t["sent"] if t["sent"] else None
        arows.append(
            [
                kind,
                t["what"],
                t["sent"],
                ", ".join(f"{k}: {v}" for k, v in sorted(t["outcomes"].items())),
                None if share is None else f"{t['gateway_ended']} ({share:.0%})",
                ended.get("median"),
                ended.get("max"),
            ]
        )
    report.table(
        "Abuse by kind",
        [
            "kind",
            "what",
            "sent",
            "how they ended",
            "ended by the gateway",
            "after, median s",
            "after, max s",
        ],
        arows,
        "Sent: connections opened (held kinds) or requests sent. `status N`: the gateway "
        "answered; `closed by gateway`: it closed without an answer; `open at end`: still "
        "held when the abuse phase ended (the abuser then closed it); `unfinished at end`: "
        "a request still in flight then. Held connections are opened again 0.5 s after "
        "the gateway ends one.",
    )

    res = resources(samples, timeline)
    rrows = []
    for name, start, end in [*timeline.bounds, ("at rest after", timeline.end, float("inf"))]:
        inside = [s for s in samples if start <= s.t < end]
        if len(inside) < 2:
            continue
        cpu = (inside[-1].cpu - inside[0].cpu) / (inside[-1].t - inside[0].t)
        rrows.append(
            [
                name,
                len(inside),
                inside[0].rss / 2**20,
                statistics.median(s.rss for s in inside) / 2**20,
                max(s.rss for s in inside) / 2**20,
                min(s.fds for s in inside),
                statistics.median(s.fds for s in inside),
                max(s.fds for s in inside),
                f"{cpu:.0%}",
            ]
        )
    report.table(
        "Gateway resources by phase",
        [
            "phase",
            "samples",
            "RSS first MiB",
            "RSS median MiB",
            "RSS max MiB",
            "FDs min",
            "FDs median",
            "FDs max",
            "CPU",
        ],
        rrows,
        "Sampled every second: VmRSS of /proc/<pid>/status, the entries of /proc/<pid>/fd, "
        "and user + system CPU time (100% = one core) of the gateway's process.",
    )
    _goals(report, by_phase, res, gateway_alive)
    _plots(report, timeline, outcomes, samples)
    report.raw["legit"] = {"by_phase": by_phase, "by_kind": by_kind}
    report.raw["legit_requests"] = {
        "columns": ["due_s", "kind", "key", "phase", "latency_ms", "status", "error"],
        "rows": [o.as_row() for o in outcomes],
    }
    report.raw["abuse"] = abuse
    report.raw["resources"] = res
    report.raw["samples"] = {
        "columns": ["t", "rss_bytes", "fds", "cpu_s"],
        "rows": [[s.t, s.rss, s.fds, round(s.cpu, 3)] for s in samples],
    }
    report.raw["gateway_alive_at_end"] = gateway_alive
    if abuse.get("errors"):
        report.note(f"abuse process errors: {abuse['errors']}")


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f} MiB"


def _goals(
    report: Report, by_phase: dict[str, Any], res: dict[str, Any], gateway_alive: bool
) -> None:
    base, abuse = by_phase["baseline"], by_phase["abuse"]
    if base["error_rate"] is not None and abuse["error_rate"] is not None:
        rise = abuse["error_rate"] - base["error_rate"]
        report.bound(
            "legitimate error rate under abuse",
            f"at most baseline's + {ERROR_RATE_MARGIN:.0%} point",
            f"{abuse['error_rate']:.1%} (baseline {base['error_rate']:.1%})",
            rise,
            ERROR_RATE_MARGIN,
            lambda d: f"{d:.1%}",
        )
    ratio = _ratio(abuse["p99_ms"], base["p99_ms"])
    report.bound(
        "legitimate p99 under abuse",
        f"at most {P99_RATIO_MAX:g}x baseline's",
        "n/a"
        if ratio is None
        else f"{abuse['p99_ms']:.1f} ms, {ratio:.2f}x (baseline {base['p99_ms']:.1f} ms)",
        ratio,
        P99_RATIO_MAX,
        lambda d: f"{d:.2f}x",
    )
    mid_abuse, end_abuse = res["rss_mid_abuse"], res["rss_end_of_abuse"]
    growth = _ratio(end_abuse, mid_abuse)
    report.bound(
        "RSS flat under abuse",
        f"end of abuse (median of its last {WINDOW:g} s) at most "
        f"{RSS_ABUSE_GROWTH_MAX:.0%} above its middle (no growth while it goes on)",
        f"{_mib(mid_abuse)} -> {_mib(end_abuse)}",
        None if growth is None else growth - 1,
        RSS_ABUSE_GROWTH_MAX,
        lambda d: f"{d:.0%}",
    )
    report.bound(
        "RSS peak",
        f"at most {_mib(RSS_PEAK_MAX)}",
        f"{_mib(res['rss_peak'])}",
        res["rss_peak"],
        RSS_PEAK_MAX,
        lambda d: _mib(d),
    )
    legit = res["rss_end_of_baseline"]
    retained = _ratio(res["rss_at_rest_after"], legit)
    report.bound(
        "RSS back after the abuse",
        f"at rest after the run at most {RSS_RETAINED_MAX:.0%} above the end of the "
        "baseline (legitimate traffic alone: the media cache fills with its images)",
        f"{_mib(legit)} -> {_mib(res['rss_at_rest_after'])}",
        None if retained is None else retained - 1,
        RSS_RETAINED_MAX,
        lambda d: f"{d:.0%}",
    )
    fds_base, fds_end = res["fds_at_rest_before"], res["fds_at_rest_after"]
    report.bound(
        "descriptors back after the abuse",
        f"at rest after the run at most at rest before + {FD_SLACK}",
        f"at rest {fds_base} before, {fds_end} after (baseline max "
        f"{res['fds_baseline_max']}, abuse max {res['fds_abuse_max']})",
        None if fds_base is None or fds_end is None else fds_end - fds_base,
        FD_SLACK,
        lambda d: f"{d:.0f} descriptors",
    )
    report.goal(
        "gateway alive at the end",
        "running",
        "running" if gateway_alive else "exited",
        gateway_alive,
    )


def _mark_phases(ax: Any, timeline: Timeline) -> None:
    start, end = timeline.span("abuse")
    ax.axvspan(start, end, color="tab:red", alpha=0.08)
    for name, a, _ in timeline.bounds:
        ax.axvline(a, color="grey", lw=0.6, ls=":")
        ax.text(a, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="bottom", fontsize=8)


def _plots(
    report: Report, timeline: Timeline, outcomes: Sequence[Outcome], samples: Sequence[Sample]
) -> None:
    def draw_resources(ax: Any) -> None:
        t = [s.t for s in samples]
        ax.plot(t, [s.rss / 2**20 for s in samples], color="tab:blue", label="RSS")
        ax.set_ylabel("RSS, MiB", color="tab:blue")
        ax.set_xlabel("seconds")
        fds = ax.twinx()
        fds.plot(t, [s.fds for s in samples], color="tab:orange", label="open FDs")
        fds.set_ylabel("open file descriptors", color="tab:orange")
        _mark_phases(ax, timeline)
        ax.set_title("Gateway RSS and descriptors (abuse phase shaded)", pad=14)

    def draw_latency(ax: Any) -> None:
        ok = [o for o in outcomes if o.ok and o.latency is not None]
        bad = [o for o in outcomes if not o.ok]
        ax.scatter([o.due for o in ok], [(o.latency or 0) * 1000 for o in ok], s=3, label="2xx")
        ax.scatter(
            [o.due for o in bad],
            [(o.latency or 0.001) * 1000 for o in bad],
            s=6,
            marker="x",
            color="tab:red",
            label="error",
        )
        ax.set_yscale("log")
        ax.set_xlabel("seconds (scheduled start)")
        ax.set_ylabel("latency, ms")
        ax.legend(loc="upper left", fontsize=8)
        _mark_phases(ax, timeline)
        ax.set_title("Legitimate requests (errors without an answer at 1 ms)", pad=14)

    report.plot("soak_resources", draw_resources, size=(9, 4))
    report.plot("soak_latency", draw_latency, size=(9, 4))
