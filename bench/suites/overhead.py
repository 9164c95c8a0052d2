"""Suite `overhead`: what the gateway adds over talking to the engine directly.

Direct, the gateway and (when installed) the peers, nginx, vllm-router and sglang-router
each with its round_robin and cache_aware policy, sit in front of the same zero-latency
simulated engine and are measured in one run, interleaved. Cases: small chat, streaming
chat (first chunk, gaps), 64-sentence embeddings, a 1 MB `data:` image at each validation
depth, and inline fetching from a loopback origin. The LiteLLM proxy, some hundred times
dearer, gets a case of its own with fewer requests; the cache-aware row
(`bench/suites/cache_aware.py`) puts the gateway's affinity policy against the routers'
cache_aware in front of two engines.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import orjson

from bench.harness.origin import RecordingServer, Route
from bench.harness.process_tree import cpu_seconds
from bench.harness.realvllm.launcher import Engine
from bench.harness.server import Server
from bench.suites import cache_aware, loadgen
from bench.suites.fleet import LITELLM_KEY, Fleet, RunConfig, Target, discover_model
from bench.suites.loadgen import KeepAliveClient, Load, LoadResult, in_turn, raw_request
from bench.suites.real_engines import RealRunConfig
from bench.suites.report import Report, fmt, paired_ratios, progress, spread

CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"

# The overhead goals (one core, zero-latency engine; bench/README.md, "Goals").
GOAL_ADDED_P50_US = 250.0
GOAL_RPS_64 = 5000.0
GOAL_STREAM_FIRST_CHUNK_MS = 0.5
# A 1 MB data: image: with its verdict cached, the added p50 within this factor of the
# floor's (bench/suites/floor.py); at the default depth, within the floor plus Pillow's decode.
GOAL_IMAGE_CACHED_RATIO = 1.5


def small_chat(model: str, stream: bool = False, max_tokens: int = 8) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in one word."}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


_WORDS = (
    "the gateway engine cache prefix token image request stream latency router policy model "
    "prompt batch queue worker socket header body answer question number colour rectangle "
    "white background measure median spread ratio baseline proxy upstream"
)


def sentences(count: int, words: int = 95, seed: int = 6) -> list[str]:
    """`count` distinct sentences of about `words` words (~127 tokens at ~1.3 tokens/word)."""
    rng = random.Random(seed)
    vocab = _WORDS.split()
    return [" ".join(rng.choice(vocab) for _ in range(words)) + "." for _ in range(count)]


def embeddings_body(model: str, count: int = 64) -> bytes:
    return orjson.dumps({"model": model, "input": sentences(count)})


def noise_png(target_bytes: int = 1_000_000, seed: int = 1) -> bytes:
    """A PNG of random pixels of about `target_bytes` (noise does not compress)."""
    from PIL import Image

    side = int((target_bytes / 3) ** 0.5)
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_chat(model: str, url: str) -> bytes:
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What number is in the picture?"},
    ]
    return orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    )


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


# --- measurement helpers ----------------------------------------------------------------


def latency_case(
    report: Report,
    title: str,
    targets: Sequence[Target],
    path: str,
    body: bytes | Sequence[bytes],
    samples: int,
    block: int,
    warmup: int,
) -> dict[str, Any]:
    """Interleaved latency at one connection; added p50/p99 against the first target.
    Several bodies are sent in turn."""
    progress(f"{title}: {samples} samples per target, blocks of {block}")
    runs = {t.name: (t, [raw_request(t, path, b) for b in in_turn(body)]) for t in targets}
    result = loadgen.interleaved_latency(runs, samples, block, warmup, progress)
    base_name = targets[0].name
    base = spread(result[base_name]["samples"])
    rows = []
    raw: dict[str, Any] = {}
    for t in targets:
        rec = result[t.name]
        s = spread(rec["samples"])
        added_blocks = [
            m - b
            for m, b in zip(rec["block_medians"], result[base_name]["block_medians"], strict=False)
        ]
        added = {
            "p50": s.get("median", 0) - base.get("median", 0) if s else None,
            "p99": s.get("p99", 0) - base.get("p99", 0) if s else None,
            "block_min": min(added_blocks) if added_blocks else None,
            "block_max": max(added_blocks) if added_blocks else None,
        }
        raw[t.name] = {"latency_us": s, "added_us": added, "statuses": rec["statuses"]}
        rows.append(
            [
                t.name,
                s.get("median"),
                s.get("p99"),
                None if t.name == base_name else added["p50"],
                None if t.name == base_name else added["p99"],
                ""
                if t.name == base_name
                else f"{fmt(added['block_min'])} .. {fmt(added['block_max'])}",
                json.dumps(rec["statuses"]),
            ]
        )
    report.table(
        title,
        [
            "target",
            "p50 us",
            "p99 us",
            "added p50 us",
            "added p99 us",
            "added p50 per block",
            "statuses",
        ],
        rows,
    )
    report.raw[title] = raw
    return raw


def streaming_case(
    report: Report, targets: Sequence[Target], body: bytes, rounds: int
) -> dict[str, Any]:
    progress(f"streaming chat: {rounds} interleaved rounds")
    clients = {t.name: KeepAliveClient(t.host, t.port) for t in targets}
    raws = {t.name: raw_request(t, CHAT, body) for t in targets}
    first: dict[str, list[float]] = {t.name: [] for t in targets}
    gaps: dict[str, list[float]] = {t.name: [] for t in targets}
    statuses: dict[str, dict[str, int]] = {t.name: {} for t in targets}
    try:
        for i in range(rounds + 20):
            for t in targets:
                try:
                    timing = loadgen.stream_timing(clients[t.name], raws[t.name])
                    key = str(timing.status)
                except OSError:
                    timing, key = None, "error"
                statuses[t.name][key] = statuses[t.name].get(key, 0) + 1
                if i >= 20 and timing is not None and timing.status == 200:  # 20 warm-up rounds
                    first[t.name].append(timing.first_chunk_us)
                    gaps[t.name].extend(timing.gaps_us)
    finally:
        for c in clients.values():
            c.close()
    base = targets[0].name
    rows, raw = [], {}
    for t in targets:
        f, g = spread(first[t.name]), spread(gaps[t.name])
        added = f.get("median", 0) - spread(first[base]).get("median", 0) if f else None
        raw[t.name] = {
            "first_chunk_us": f,
            "gap_us": g,
            "added_first_chunk_us": added,
            "statuses": statuses[t.name],
        }
        rows.append(
            [
                t.name,
                f.get("median"),
                f.get("p99"),
                None if t.name == base else added,
                g.get("median"),
                g.get("p99"),
                json.dumps(statuses[t.name]),
            ]
        )
    report.table(
        "Streaming chat at 1 connection",
        [
            "target",
            "first chunk p50 us",
            "first chunk p99 us",
            "added first chunk p50 us",
            "gap p50 us",
            "gap p99 us",
            "statuses",
        ],
        rows,
        "Gaps: time between SSE frames as read from the socket; frames read together count 0.",
    )
    report.raw["streaming"] = raw
    return raw


def throughput_case(
    report: Report,
    targets: Sequence[Target],
    body: bytes | tuple[bytes, ...],
    connections: int,
    duration: float,
    repeats: int,
    generator: loadgen.Generator,
    title: str = "Small chat throughput",
    key: str = "throughput",
) -> dict[str, Any]:
    """Throughput and CPU per request, repeated A, B, C, A, B, C; ratios to direct. The
    table is `title` at N connections, the raw figures `key`_N."""
    progress(f"{title} at {connections} connections: {repeats} x {duration}s per target")
    # Warm-up: a short run each, thrown away.
    for t in targets:
        generator(t, Load(CHAT, body, connections, min(1.0, duration)))
    runs: dict[str, list[LoadResult]] = {t.name: [] for t in targets}
    for r in range(repeats):
        for t in targets:
            before = cpu_seconds(t.pid) if t.pid else None
            res = generator(t, Load(CHAT, body, connections, duration))
            if before is not None and t.pid:
                res.cpu_s = cpu_seconds(t.pid) - before
            runs[t.name].append(res)
            progress(f"  repeat {r + 1}: {t.name} {res.rps:,.0f} req/s, {res.errors} errors")
    base = targets[0].name
    base_rps = [x.rps for x in runs[base]]
    rows, raw = [], {}
    for t in targets:
        rps = [x.rps for x in runs[t.name]]
        ratio = paired_ratios(rps, base_rps)
        cpu = [x.cpu_us_per_request for x in runs[t.name] if x.cpu_us_per_request is not None]
        raw[t.name] = {
            "runs": [x.as_dict() for x in runs[t.name]],
            "rps_median": statistics.median(rps),
            "ratio_to_direct": ratio,
            "cpu_us_per_request_median": statistics.median(cpu) if cpu else None,
        }
        rows.append(
            [
                t.name,
                statistics.median(rps),
                f"{min(rps):,.0f} .. {max(rps):,.0f}",
                ratio.get("median"),
                statistics.median([x.p50_us for x in runs[t.name]]),
                statistics.median([x.p99_us for x in runs[t.name]]),
                statistics.median(cpu) if cpu else None,
                sum(x.errors for x in runs[t.name]),
            ]
        )
    report.table(
        f"{title} at {connections} connections",
        [
            "target",
            "req/s p50",
            "req/s range",
            "ratio to direct",
            "p50 us",
            "p99 us",
            "CPU us/req (the target's process)",
            "errors",
        ],
        rows,
        "CPU per request: utime+stime of the target's process tree (/proc/<pid>/stat) over "
        "the run; for `direct` that is the engine's own cost.",
    )
    report.raw[f"{key}_{connections}"] = raw
    return raw


# --- the suite -----------------------------------------------------------------------


def run(cfg: RunConfig, report: Report) -> None:
    quick = cfg.quick
    lat_samples, block, warmup = (200, 50, 50) if quick else (5000, 250, 500)
    report.meta["pinning"] = cfg.cpus.describe()
    with Fleet(cfg.workdir, cfg.cpus) as fleet:
        gen_gateway: Server | None = None
        pool_gateway: Server | None = None
        if cfg.external:
            engine = cfg.engine_urls[0]
            pool_engine = cfg.engine_urls[-1]
            direct = cfg.direct_target(engine)
            pool_direct = cfg.direct_target(pool_engine)
            gateway = cfg.gateway_target(cfg.gateway_url or "")
            pool_gw = gateway
        else:
            sim: Server | Engine
            pool: Server | Engine
            if isinstance(cfg, RealRunConfig) and cfg.real is not None:
                progress(f"real engines: {cfg.real.label}")
                sim, pool = cfg.real.generate, cfg.real.pooling
            else:
                progress("starting simulated engines (zero latency) and gateways")
                sim, pool = fleet.at_once(
                    partial(fleet.sim, "--latency", "zero", "--runner", "generate",
                            name="sim-generate"),
                    partial(fleet.sim, "--latency", "zero", "--runner", "pooling",
                            name="sim-pooling"),
                )  # fmt: skip
            gen_gateway, pool_gateway = fleet.at_once(
                partial(fleet.gateway, [sim.url], name="gateway"),
                partial(fleet.gateway, [pool.url], name="gateway-pooling"),
            )
            direct = cfg.direct_target(sim.url, sim.pid)
            pool_direct = cfg.direct_target(pool.url, pool.pid)
            gateway = cfg.gateway_target(gen_gateway.url, gen_gateway.pid)
            pool_gw = cfg.gateway_target(pool_gateway.url, pool_gateway.pid)
        model = cfg.model or discover_model(direct)
        pool_model = cfg.model or discover_model(pool_direct)
        report.meta["model"] = model

        peers: list[Target] = []
        with_peers = cfg.peers and not cfg.external and not isinstance(cfg, RealRunConfig)
        if with_peers:
            peers = start_peers(report, fleet, direct.url)
        elif not cfg.peers:
            report.note("peers: skipped (--no-peers)")
        if cfg.baseline_tree is not None and gen_gateway is not None:
            # The same gateway settings from another checkout, as a peer: before and
            # after a change, measured in one interleaved run.
            baseline = fleet.gateway([sim.url], name="gateway-baseline", tree=cfg.baseline_tree)
            peers.insert(0, cfg.gateway_target(baseline.url, baseline.pid, "gateway-baseline"))
            report.note(f"gateway-baseline: the gateway of {cfg.baseline_tree}")
        targets = [direct, gateway, *peers]

        if cfg.images_only:
            report.note("images only (--images-only): the other cases were not run")
            image_goals(report, image_cases(cfg, report, fleet, direct, gateway, model))
            return

        chat = small_chat(model)
        generator = loadgen.select(cfg.loadgen, direct, CHAT, chat, quick, report)

        small = latency_case(
            report, "Small chat at 1 connection", targets, CHAT, chat, lat_samples, block, warmup
        )
        stream = streaming_case(report, targets, small_chat(model, True, 16), 40 if quick else 500)
        latency_case(
            report,
            "Embeddings, 64 sentences, at 1 connection",
            [pool_direct, pool_gw],
            EMBED,
            embeddings_body(pool_model),
            # ~0.1 s a request on the simulated engine, which embeds each sentence.
            10 if quick else 400,
            5 if quick else 50,
            2 if quick else 50,
        )

        duration, repeats = (0.5, 1) if quick else (4.0, 3)
        tput: dict[int, dict[str, Any]] = {}
        for conns in (64,) if quick else (64, 256):
            tput[conns] = throughput_case(
                report, targets, chat, conns, duration, repeats, generator
            )

        litellm: dict[str, Any] = {}
        row: dict[str, dict[str, dict[str, float | None]]] = {}
        if with_peers:
            litellm = litellm_case(cfg, report, fleet, direct, gateway, model, generator)
            row = cache_aware_row(cfg, report, fleet, model, generator)

        images = image_cases(cfg, report, fleet, direct, gateway, model)

    goals(report, small, stream, tput)
    if with_peers:
        cache_aware.goals(report, row)
        peer_goal(report, small, litellm)
    against_baseline(report, small, stream, tput)
    image_goals(report, images)
    plots(report, small, stream, tput)


# Each peer: its target name, how the fleet starts it in front of one engine, and how
# to install it (a peer not installed is skipped with this note).
PEERS: tuple[tuple[str, Callable[[Fleet, str], Server | None], str], ...] = (
    ("nginx", lambda f, e: f.nginx(e), "apt-get install nginx-light"),
    ("vllm-router", lambda f, e: f.vllm_router([e]), ".venv/bin/pip install vllm-router"),
    (
        "vllm-router cache_aware",
        lambda f, e: f.vllm_router([e], "cache_aware", "vllm-router-cache-aware"),
        ".venv/bin/pip install vllm-router",
    ),
    ("sglang-router", lambda f, e: f.sglang_router([e]), ".venv/bin/pip install sglang-router"),
    (
        "sglang-router cache_aware",
        lambda f, e: f.sglang_router([e], "cache_aware", "sglang-router-cache-aware"),
        ".venv/bin/pip install sglang-router",
    ),
)
LITELLM = "litellm"
LITELLM_INSTALL = (
    "python3 -m venv ~/.cache/vllm-gateway/litellm-venv && "
    "~/.cache/vllm-gateway/litellm-venv/bin/pip install 'litellm[proxy]', or --litellm PATH"
)


def start_peers(report: Report, fleet: Fleet, engine: str) -> list[Target]:
    """The peers in front of `engine` (vllm-router and sglang-router with round_robin
    under their own names), each pinned like the gateway; the ones not installed are
    skipped with a note."""
    peers = []
    for name, start, install in PEERS:
        server = start(fleet, engine)
        if server is None:
            report.note(f"{name}: not installed ({install}), skipped")
        else:
            peers.append(Target(name, server.url, {}, server.pid))
    return peers


def litellm_case(
    cfg: RunConfig,
    report: Report,
    fleet: Fleet,
    direct: Target,
    gateway: Target,
    model: str,
    generator: loadgen.Generator,
) -> dict[str, Any]:
    """The LiteLLM proxy beside direct and the gateway, with its own small request count
    (some hundred times dearer than the others: the main cases' counts would take most
    of an hour): small chat at one connection, and throughput at 64 connections."""
    server = fleet.litellm(direct.url, model, cfg.litellm)
    if server is None:
        report.note(f"{LITELLM}: not installed ({LITELLM_INSTALL}), skipped")
        return {}
    proxy = Target(LITELLM, server.url, {"Authorization": f"Bearer {LITELLM_KEY}"}, server.pid)
    targets = [direct, gateway, proxy]
    samples, block, warmup = (20, 10, 5) if cfg.quick else (400, 40, 40)
    small = latency_case(
        report, "LiteLLM: small chat at 1 connection", targets, CHAT, small_chat(model),
        samples, block, warmup,
    )  # fmt: skip
    duration, repeats = (0.5, 1) if cfg.quick else (4.0, 2)
    tput = throughput_case(
        report, targets, small_chat(model), 64, duration, repeats, generator,
        "LiteLLM: small chat throughput", "litellm_throughput",
    )  # fmt: skip
    server.stop()
    return {"small": small, "throughput_64": tput}


def cache_aware_row(
    cfg: RunConfig, report: Report, fleet: Fleet, model: str, generator: loadgen.Generator
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Issue 30's goal 1 (bench/suites/cache_aware.py): the gateway with affinity against
    the cache_aware routers, all in front of the same two fresh engines, on 12
    conversations under one system prompt; direct is the first engine. Returns
    `figures[case][figure][target]` for `cache_aware.goals`."""
    progress("cache-aware row: two more simulated engines, the gateway with affinity, routers")
    engines = fleet.at_once(
        *(
            partial(fleet.sim, "--latency", "zero", "--runner", "generate", name=f"sim-{n}")
            for n in ("a", "b")
        )
    )
    urls = [e.url for e in engines]
    gw = fleet.gateway(urls, cache_aware.GATEWAY_ENV, name="gateway-affinity")
    targets = [
        cfg.direct_target(urls[0], engines[0].pid),
        cfg.gateway_target(gw.url, gw.pid, cache_aware.GATEWAY),
    ]
    servers = [*engines, gw]
    for name, start in zip(
        cache_aware.ROUTERS, (fleet.vllm_router, fleet.sglang_router), strict=True
    ):
        router = start(urls, "cache_aware", name.replace(" ", "-"))
        if router is None:
            report.note(f"{name}: not installed, the cache-aware row goes without it")
        else:
            servers.append(router)
            targets.append(Target(name, router.url, {}, router.pid))
    samples, block, warmup = (120, 24, 24) if cfg.quick else (3000, 240, 240)
    duration, repeats = (0.5, 1) if cfg.quick else (4.0, 3)
    figures: dict[str, dict[str, dict[str, float | None]]] = {}
    for case, (stream, tokens) in cache_aware.CASES.items():
        bodies = cache_aware.bodies(model, stream, tokens)
        title = f"Cache-aware row, {case}: {cache_aware.CONVERSATIONS} conversations, 2 engines"
        raw = latency_case(
            report, f"{title}, at 1 connection", targets, CHAT, bodies, samples, block, warmup
        )
        tput = throughput_case(
            report, targets, bodies, 64, duration, repeats, generator, title,
            f"cache_aware_{case.replace(' ', '_')}",
        )  # fmt: skip
        figures[case] = {
            "added p50": {t.name: raw[t.name]["added_us"]["p50"] for t in targets[1:]},
            "CPU per request at 64 connections": {
                t.name: tput[t.name]["cpu_us_per_request_median"] for t in targets[1:]
            },
        }
    # Stopped now: their health checks would run beside the image cases.
    for server in servers:
        server.stop()
    report.raw["cache_aware_row"] = figures
    return figures


def peer_goal(report: Report, small: dict[str, Any], litellm: dict[str, Any]) -> None:
    """Issue 30, goal 4: every peer measured beside the gateway in this run."""
    names = [name for name, _, _ in PEERS] + [LITELLM]
    measured = [n for n in names if n in small or (n == LITELLM and litellm)]
    missing = [n for n in names if n not in measured]
    report.goal(
        "issue 30 goal 4: every peer measured in the same run",
        ", ".join(names),
        ", ".join(measured) or "none",
        not missing,
        f"not installed: {', '.join(missing)}" if missing else "",
    )


def image_cases(
    cfg: RunConfig,
    report: Report,
    fleet: Fleet,
    direct: Target,
    gateway: Target,
    model: str,
) -> dict[str, Any]:
    """1 MB data: image per validation depth, each next to its floor (bench/suites/floor.py, in
    the same blocks), Pillow's decode of the image alone, and inline fetching from a
    loopback origin. Returns the figures the image goals read (`image_goals`).

    The gateway may refuse these (the media features land separately): statuses are
    recorded and shown, never treated as a crash.
    """
    png = noise_png()
    body = image_chat(model, data_url(png))
    samples, block, warmup = (10, 5, 2) if cfg.quick else (200, 20, 10)
    report.note(f"image: {len(png):,} bytes of PNG noise, {len(body):,} bytes of request body")
    figures: dict[str, Any] = {"cases": {}}
    if cfg.external:
        latency_case(
            report,
            "1 MB data: image (validation as configured)",
            [direct, gateway],
            CHAT,
            body,
            samples,
            block,
            warmup,
        )
        return figures
    figures["pillow_decode_us"] = pillow_decode_us(png, cfg.cpus.proxy, 10 if cfg.quick else 100)
    # The floor runs under the gateway's allocator policy (like for like); a second one,
    # next to the cached case only, under glibc's default (what that policy costs).
    # Next to the default depth only: the floor that also decodes the image (the third),
    # so the goal is read against one figure measured in the same blocks, not only
    # against a sum.
    engines = [direct.url]
    # The same body is sent every time: with the media cache off each request pays the
    # full validation at its depth (a new image); the last case, cache on, is the cost of
    # an image the gateway has already validated (a conversation re-sending it).
    cases = [
        (f"validation={depth}", depth, {"GATEWAY_MEDIA__CACHE_BYTES": "0"})
        for depth in ("header", "decode", "reencode")
    ]
    cases.append(("validation=decode, already validated (cache on)", "decode-cached", {}))

    def case_env(label: str, extra: dict[str, str]) -> dict[str, str]:
        return {"GATEWAY_MEDIA__VALIDATION": label.split("-")[0], **extra}

    # A smoke run starts the cases' gateways with the floors, side by side (it measures
    # nothing: their health checks may run beside another case); a measurement starts
    # each gateway beside its case only.
    early = [
        partial(fleet.gateway, engines, case_env(label, extra), name=f"gateway-{label}")
        for _, label, extra in (cases if cfg.quick else [])
    ]
    floor_server, plain_server, decoding_server, *gateways = fleet.at_once(
        partial(fleet.floor, direct.url),
        partial(fleet.floor, direct.url, "default", name="floor-default-malloc"),
        partial(fleet.floor, direct.url, name="floor-decode", decode=True),
        *early,
    )
    started = {label: gw for (_, label, _), gw in zip(cases, gateways, strict=False)}
    floor = Target("floor", floor_server.url, {}, floor_server.pid)
    plain = Target("floor, glibc default malloc", plain_server.url, {}, plain_server.pid)
    decoding = Target("floor + decode", decoding_server.url, {}, decoding_server.pid)
    for title, label, extra in cases:
        env = case_env(label, extra)
        gw = started.get(label) or fleet.gateway(engines, env, name=f"gateway-{label}")
        name, base_name = f"gateway ({label})", f"gateway-baseline ({label})"
        # With --baseline-tree, the other checkout's gateway in the same blocks.
        base = None
        if cfg.baseline_tree is not None:
            base = fleet.gateway(
                engines, env, name=f"gateway-baseline-{label}", tree=cfg.baseline_tree
            )
        try:
            raw = latency_case(
                report,
                f"1 MB data: image, {title}",
                [
                    direct,
                    floor,
                    *([plain] if label == "decode-cached" else []),
                    *([decoding] if label == "decode" else []),
                    *([cfg.gateway_target(base.url, base.pid, base_name)] if base else []),
                    cfg.gateway_target(gw.url, gw.pid, name),
                ],
                CHAT,
                body,
                samples,
                block,
                warmup,
            )
        finally:
            gw.stop()
            if base is not None:
                base.stop()
        figures["cases"][label] = {
            "floor_added_us": raw["floor"]["added_us"]["p50"],
            "gateway_added_us": raw[name]["added_us"]["p50"],
            "statuses": raw[name]["statuses"],
        }
        if base is not None:
            figures["cases"][label]["baseline_added_us"] = raw[base_name]["added_us"]["p50"]
        if label == "decode-cached":
            figures["floor_default_malloc_added_us"] = raw[plain.name]["added_us"]["p50"]
        if label == "decode":
            figures["floor_decode_added_us"] = raw[decoding.name]["added_us"]["p50"]
            figures["floor_decode_statuses"] = raw[decoding.name]["statuses"]
    floor_server.stop()
    plain_server.stop()
    decoding_server.stop()
    image_floor_table(report, figures)
    image_against_baseline(report, figures)
    # Two origins, one per inline gateway, so each one's served requests are counted.
    # The gateway caches fetched media by URL (GATEWAY_MEDIA__CACHE_BYTES): with the cache
    # on, every request after the first is a cache hit and measures no fetch at all (the
    # run of 2026-11-29 reported only that). One gateway runs with the cache off, one
    # with it on, interleaved.
    route = {"/image.png": Route(body=png, headers={"Content-Type": "image/png"})}
    with RecordingServer(route) as origin, RecordingServer(route) as cached_origin:
        env = {
            "GATEWAY_MEDIA__MODE": "inline",
            # A rule without a port admits the scheme's default port only.
            "GATEWAY_MEDIA__ALLOWED_DOMAINS": json.dumps(
                [f"127.0.0.1:{origin.port}", f"127.0.0.1:{cached_origin.port}"]
            ),
            "GATEWAY_MEDIA__ALLOWED_SCHEMES": json.dumps(["http", "https"]),
            "GATEWAY_MEDIA__ALLOWED_NETWORKS": json.dumps(["127.0.0.0/8"]),
        }
        gw, cgw = fleet.at_once(
            partial(
                fleet.gateway,
                engines,
                {**env, "GATEWAY_MEDIA__CACHE_BYTES": "0"},
                name="gateway-inline",
            ),
            partial(fleet.gateway, engines, env, name="gateway-inline-cached"),
        )
        try:
            inline = cfg.gateway_target(gw.url, gw.pid, "gateway (data: URL)")
            fetched = cfg.gateway_target(gw.url, gw.pid, "gateway (inline fetch, no cache)")
            cached = cfg.gateway_target(cgw.url, cgw.pid, "gateway (inline fetch, cached)")
            progress("inline fetch from a loopback origin")
            runs = {
                "direct (data: URL)": (direct, raw_request(direct, CHAT, body)),
                inline.name: (inline, raw_request(inline, CHAT, body)),
                fetched.name: (
                    fetched,
                    raw_request(fetched, CHAT, image_chat(model, f"{origin.url}/image.png")),
                ),
                cached.name: (
                    cached,
                    raw_request(cached, CHAT, image_chat(model, f"{cached_origin.url}/image.png")),
                ),
            }
            res = loadgen.interleaved_latency(runs, samples, block, warmup)
        finally:
            gw.stop()
            cgw.stop()
    rows = []
    for name, rec in res.items():
        s = spread(rec["samples"])
        rows.append([name, s.get("median"), s.get("p99"), json.dumps(rec["statuses"])])
    d, f, c = (
        spread(res[k]["samples"]).get("median") for k in (inline.name, fetched.name, cached.name)
    )
    # Cost per image: the uncached gateway minus the cached one. Both receive the same
    # small request and send the engine the same data: URL; the difference is the fetch
    # plus the validation (a cache hit skips both). Against the client sending the image
    # itself as a data: URL the fetch can come out cheaper (the client uploads 1.33 MB of
    # base64 instead of the origin serving 1 MB of PNG), so that difference is shown too.
    cost = f - c if f is not None and c is not None else None
    vs_data = f - d if d is not None and f is not None else None
    served, cached_served = len(origin.hits), len(cached_origin.hits)
    report.table(
        "Inline fetch of a 1 MB image from a loopback origin",
        ["target", "p50 us", "p99 us", "statuses"],
        rows,
        f"Fetch and validation cost per image (inline fetch p50 with the cache off minus "
        f"with it on; validation at the default depth, decode): {fmt(cost)} us; origin "
        f"requests served: {served:,} with the cache off, {cached_served:,} with it on. "
        f"Inline fetch minus the same image sent as a data: URL through the same gateway: "
        f"{fmt(vs_data)} us.",
    )
    report.raw["inline_fetch"] = {
        k: {"latency_us": spread(v["samples"]), "statuses": v["statuses"]} for k, v in res.items()
    }
    report.raw["inline_fetch"]["cost_per_image_us"] = cost
    report.raw["inline_fetch"]["fetch_minus_data_url_us"] = vs_data
    report.raw["inline_fetch"]["origin_requests"] = served
    report.raw["inline_fetch"]["cached_origin_requests"] = cached_served
    return figures


def pillow_decode_us(png: bytes, cpus: frozenset[int] | None, runs: int) -> float:
    """Median time of Pillow opening and fully decoding `png` in this process, pinned to
    `cpus` (the proxy's core) for the measurement: what decoding costs with nothing
    around it."""
    from PIL import Image

    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        times = []
        for _ in range(runs + 3):
            start = time.perf_counter_ns()
            with Image.open(io.BytesIO(png), formats=["PNG"]) as image:
                image.load()
            times.append((time.perf_counter_ns() - start) / 1000)
    finally:
        os.sched_setaffinity(0, before)
    return statistics.median(times[3:])


def image_floor_table(report: Report, figures: dict[str, Any]) -> None:
    pillow = figures["pillow_decode_us"]
    rows = []
    for label, case in figures["cases"].items():
        floor, added = case["floor_added_us"], case["gateway_added_us"]
        ratio = added / floor if added is not None and floor else None
        over = added - floor if added is not None and floor is not None else None
        rows.append([label, floor, added, ratio, over, json.dumps(case["statuses"])])
    report.table(
        "1 MB data: image against its floor",
        [
            "gateway",
            "floor added p50 us",
            "gateway added p50 us",
            "ratio to floor",
            "gateway minus floor us",
            "statuses",
        ],
        rows,
        f"Floor: bench/suites/floor.py in the same blocks (reads the body, parses it, hashes the "
        f"image's base64 text, writes the body on), under the gateway's allocator policy "
        f"(glibc mmap threshold 4 MiB, trim threshold 8 MiB); under glibc's default, next "
        f"to the cached case: "
        f"{fmt(figures.get('floor_default_malloc_added_us'))} us added. Pillow's decode of "
        f"the image alone (open + load, median, on the proxy's core): {fmt(pillow)} us. "
        f"The floor that also decodes the image (base64 and Pillow's open + load, in line), "
        f"next to the default depth: {fmt(figures.get('floor_decode_added_us'))} us added.",
    )
    report.raw["image_floor"] = figures


def added_at_most(
    report: Report, name: str, target: str, added: float | None, limit: float, note: str = ""
) -> None:
    """A goal that the microseconds `added` stay at most `limit`; the measured figure is
    shown in us, then `note`."""
    report.bound(name, target, f"{fmt(added)} us{note}", added, limit, lambda d: f"{d:.0f} us")


def image_goals(report: Report, figures: dict[str, Any]) -> None:
    """The image goals, from `image_cases`' figures (not measured: external runs)."""
    cases = figures.get("cases", {})
    cached = cases.get("decode-cached", {})
    floor, added = cached.get("floor_added_us"), cached.get("gateway_added_us")
    name = "1 MB image, verdict cached: added p50 within 1.5x of the floor"
    if floor is None:
        report.goal(name, f"<= {GOAL_IMAGE_CACHED_RATIO} x floor", "not measured", None)
    else:
        added_at_most(
            report,
            name,
            f"<= {GOAL_IMAGE_CACHED_RATIO} x floor ({fmt(GOAL_IMAGE_CACHED_RATIO * floor)} us)",
            added,
            GOAL_IMAGE_CACHED_RATIO * floor,
            f" (floor {fmt(floor)} us)",
        )
    default = cases.get("decode", {})
    floor, added = default.get("floor_added_us"), default.get("gateway_added_us")
    pillow = figures.get("pillow_decode_us")
    name = "1 MB image, default depth: added p50 <= floor + Pillow's decode alone"
    if floor is None or pillow is None:
        report.goal(name, "<= floor + Pillow's decode", "not measured", None)
        return
    added_at_most(report, name, f"<= {fmt(floor)} + {fmt(pillow)} us", added, floor + pillow)
    decoding = figures.get("floor_decode_added_us")
    name = "1 MB image, default depth: added p50 <= the floor that decodes, same blocks"
    if decoding is None:
        report.goal(name, "<= floor + decode", "not measured", None)
        return
    added_at_most(report, name, f"<= {fmt(decoding)} us", added, decoding)


def against_router(
    report: Report, name: str, gateway: float | None, router: float | None, unit: str
) -> None:
    """A goal that the gateway's `gateway` is no more than vllm-router's `router`,
    both measured in this run."""
    cache_aware.against_peer(report, name, "vllm-router", gateway, router, unit)


def image_against_baseline(report: Report, figures: dict[str, Any]) -> None:
    """With `--baseline-tree`: each image case, this checkout's gateway against the
    other's, same blocks."""
    rows = []
    for label, case in figures["cases"].items():
        if "baseline_added_us" in case:
            before, after = case["baseline_added_us"], case["gateway_added_us"]
            ratio = after / before if before and after is not None else None
            rows.append([label, before, after, ratio])
    if not rows:
        return
    report.table(
        "Images: this gateway against the baseline checkout's (added p50, us, same run)",
        ["case", "gateway-baseline", "gateway", "ratio"],
        rows,
    )
    report.raw["images_against_baseline"] = rows


def against_baseline(
    report: Report, small: dict[str, Any], stream: dict[str, Any], tput: dict[int, dict[str, Any]]
) -> None:
    """With `--baseline-tree`: this checkout's gateway against the other's, same run."""
    if "gateway-baseline" not in small:
        return
    # Each figure: its label, and how to read it for a target.
    figures: list[tuple[str, Callable[[str], float | None]]] = [
        (
            "added p50 at 1 connection, us",
            lambda t: small.get(t, {}).get("added_us", {}).get("p50"),
        ),
        (
            "streaming first chunk added, us",
            lambda t: stream.get(t, {}).get("added_first_chunk_us"),
        ),
    ]

    def cpu_per_request(connections: int) -> Callable[[str], float | None]:
        return lambda t: tput[connections].get(t, {}).get("cpu_us_per_request_median")

    figures += [
        (f"CPU per request at {c} connections, us", cpu_per_request(c)) for c in sorted(tput)
    ]
    rows = []
    for label, of in figures:
        before, after, router = of("gateway-baseline"), of("gateway"), of("vllm-router")
        ratio = after / before if before and after is not None else None
        rows.append([label, before, after, ratio, router])
    report.table(
        "This gateway against the baseline checkout's (same run)",
        ["figure", "gateway-baseline", "gateway", "ratio", "vllm-router"],
        rows,
    )
    report.raw["against_baseline"] = rows


def goals(
    report: Report, small: dict[str, Any], stream: dict[str, Any], tput: dict[int, dict[str, Any]]
) -> None:
    gw = small.get("gateway", {}).get("added_us", {}).get("p50")
    router = small.get("vllm-router", {}).get("added_us", {}).get("p50")
    added_at_most(
        report,
        "added latency p50 at 1 connection",
        f"<= {GOAL_ADDED_P50_US:.0f} us",
        gw,
        GOAL_ADDED_P50_US,
    )
    against_router(report, "added latency p50 no more than vllm-router's", gw, router, "us")
    rps = tput.get(64, {}).get("gateway", {}).get("rps_median")
    report.bound(
        "small requests/s at 64 connections",
        f">= {GOAL_RPS_64:,.0f}",
        f"{fmt(rps)}",
        rps,
        GOAL_RPS_64,
        lambda d: f"{d:,.0f} req/s",
        at_most=False,
    )
    cpu = tput.get(64, {})
    against_router(
        report,
        "CPU per small request at 64 connections no more than vllm-router's",
        cpu.get("gateway", {}).get("cpu_us_per_request_median"),
        cpu.get("vllm-router", {}).get("cpu_us_per_request_median"),
        "us",
    )
    added = stream.get("gateway", {}).get("added_first_chunk_us")
    limit = GOAL_STREAM_FIRST_CHUNK_MS * 1000
    added_at_most(report, "streaming first chunk added", f"<= {limit:.0f} us", added, limit)
    against_router(
        report,
        "streaming first chunk added no more than vllm-router's",
        added,
        stream.get("vllm-router", {}).get("added_first_chunk_us"),
        "us",
    )


def plots(
    report: Report, small: dict[str, Any], stream: dict[str, Any], tput: dict[int, dict[str, Any]]
) -> None:
    names = [n for n in small if n != "direct"]

    def added(ax: Any) -> None:
        p50 = [small[n]["added_us"]["p50"] or 0 for n in names]
        p99 = [small[n]["added_us"]["p99"] or 0 for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], p50, 0.4, label="added p50")
        ax.bar([x + 0.2 for x in xs], p99, 0.4, label="added p99")
        ax.axhline(GOAL_ADDED_P50_US, color="red", linestyle="--", label="goal p50")
        # Seven targets with the peers: slanted names stay apart.
        ax.set_xticks(list(xs), names, rotation=20, ha="right")
        ax.set_ylabel("microseconds over direct")
        ax.set_title("Small chat, 1 connection: latency added over direct")
        ax.legend()

    report.plot("overhead_added_latency", added, size=(9, 4.5))

    def throughput(ax: Any) -> None:
        conns = sorted(tput)
        all_names = list(next(iter(tput.values())))
        width = 0.8 / max(1, len(all_names))
        for i, n in enumerate(all_names):
            ax.bar(
                [c + i * width for c in range(len(conns))],
                [tput[c][n]["rps_median"] for c in conns],
                width,
                label=n,
            )
        ax.set_xticks(
            [c + 0.4 - width / 2 for c in range(len(conns))], [f"{c} conns" for c in conns]
        )
        ax.set_ylabel("requests/s (median of repeats)")
        ax.axhline(GOAL_RPS_64, color="red", linestyle="--", label="goal at 64")
        ax.set_title("Small chat throughput")
        ax.legend()

    if tput:
        report.plot("overhead_throughput", throughput, size=(9, 4.5))

    def first_chunk(ax: Any) -> None:
        ns = list(stream)
        ax.bar(ns, [stream[n]["first_chunk_us"].get("median", 0) for n in ns])
        ax.set_xticks(range(len(ns)), ns, rotation=20, ha="right")
        ax.set_ylabel("time to first chunk p50, us")
        ax.set_title("Streaming chat, 1 connection")

    report.plot("overhead_first_chunk", first_chunk, size=(9, 4.5))
