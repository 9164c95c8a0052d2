"""Suite `reference`: the GPU reference run's measurements (docs/vllm.md) through the gateway.

Each measurement runs direct to the engine and through the gateway in the same run,
alternating: time to first token for images (new, repeated, new question) at 448 and 896
pixels, 64 embedded sentences, 32 reranked documents, and the SSRF probe table.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.origin import RecordingServer
from bench.harness.realvllm.launcher import Engine
from bench.harness.server import Server
from bench.suites import loadgen
from bench.suites.fleet import Fleet, RunConfig, Target, discover_model
from bench.suites.loadgen import KeepAliveClient, raw_request
from bench.suites.overhead import CHAT, EMBED, data_url, embeddings_body, sentences
from bench.suites.real_engines import RealRunConfig
from bench.suites.report import Report, fmt, progress, spread

# The reference run on a laptop GPU (docs/vllm.md), for the side-by-side column.
SEED_TTFT_MS = {
    (448, "new image"): 67.9,
    (896, "new image"): 238.0,
    (448, "same image and question"): 31.8,
    (896, "same image and question"): 32.7,
    (448, "same image, new question"): 32.1,
    (896, "same image, new question"): 33.4,
}
SEED_EMBED_MS = 371.8
SEED_RERANK_MS = 33.9
COLOURS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def drawn_image(size: int, number: int) -> bytes:
    """A PNG: white background, a coloured rectangle and a four-digit number."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    colour = COLOURS[number % len(COLOURS)]
    draw.rectangle((size // 8, size // 8, size * 5 // 8, size * 3 // 8), fill=colour)
    font = ImageFont.load_default(size=size // 6)
    draw.text((size // 8, size // 2), f"{number % 10000:04d}", fill="black", font=font)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_question(model: str, png: bytes, question: str) -> bytes:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png)}},
        {"type": "text", "text": question},
    ]
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "stream": True,
        }
    )


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                total += s.value
    return total


def scrape(target: Target) -> str:
    with KeepAliveClient(target.host, target.port, timeout=10) as c:
        return c.send(raw_request(target, "/metrics", None, "GET")).body.decode()


def ttft_case(
    report: Report, direct: Target, gateway: Target, model: str, rounds: int
) -> dict[str, Any]:
    """Time to first token for images, alternating direct and gateway at every step.

    Each side gets its own images (different numbers) so one side never warms the
    engine's cache for the other.
    """
    steps = ("new image", "same image and question", "same image, new question")
    ttft: dict[tuple[int, str, str], list[float]] = {}
    statuses: dict[str, dict[str, int]] = {direct.name: {}, gateway.name: {}}
    before = scrape(direct)
    clients = {t.name: KeepAliveClient(t.host, t.port) for t in (direct, gateway)}
    serial = int(time.time()) % 5000
    try:
        for size in (448, 896):
            progress(f"image TTFT at {size}x{size}: {rounds} rounds")
            for r in range(rounds):
                pngs = {
                    t.name: drawn_image(size, serial + 2 * r + i)
                    for i, t in enumerate((direct, gateway))
                }
                serial += 2 * rounds
                for step in steps:
                    question = "What number is shown?"
                    if step == "same image, new question":
                        question = "What colour is the rectangle?"
                    for t in (direct, gateway):
                        body = image_question(model, pngs[t.name], question)
                        try:
                            timing = loadgen.stream_timing(
                                clients[t.name], raw_request(t, CHAT, body)
                            )
                            key = str(timing.status)
                        except OSError:
                            timing, key = None, "error"
                        statuses[t.name][key] = statuses[t.name].get(key, 0) + 1
                        if timing is not None and timing.status == 200:
                            ttft.setdefault((size, step, t.name), []).append(
                                timing.first_chunk_us / 1000
                            )
    finally:
        for c in clients.values():
            c.close()
    after = scrape(direct)
    hits = metric_sum(after, "vllm:mm_cache_hits_total") - metric_sum(
        before, "vllm:mm_cache_hits_total"
    )
    queries = metric_sum(after, "vllm:mm_cache_queries_total") - metric_sum(
        before, "vllm:mm_cache_queries_total"
    )
    rows, raw = [], {}
    for size in (448, 896):
        for step in steps:
            d = spread(ttft.get((size, step, direct.name), []))
            g = spread(ttft.get((size, step, gateway.name), []))
            ratio = g["median"] / d["median"] if d and g and d["median"] else None
            raw[f"{size} {step}"] = {"direct_ms": d, "gateway_ms": g, "ratio": ratio}
            rows.append(
                [
                    f"{size}x{size}",
                    step,
                    SEED_TTFT_MS[(size, step)],
                    d.get("median"),
                    g.get("median"),
                    ratio,
                    f"{fmt(d.get('min'))}..{fmt(d.get('max'))} / "
                    f"{fmt(g.get('min'))}..{fmt(g.get('max'))}",
                ]
            )
    report.table(
        "Time to first token with an image (ms)",
        [
            "image",
            "step",
            "GPU reference",
            "direct p50",
            "gateway p50",
            "gateway/direct",
            "range d/g",
        ],
        rows,
        f"mm cache over the run (engine metrics): {hits:.0f} hits of {queries:.0f} queries "
        f"(GPU reference: 20 of 30). Statuses: {statuses}.",
    )
    report.raw["image_ttft"] = {"steps": raw, "mm_cache": [hits, queries], "statuses": statuses}
    return raw


def timed_posts(
    report: Report,
    title: str,
    targets: tuple[Target, Target],
    path: str,
    body: bytes,
    rounds: int,
    check: Any = None,
) -> dict[str, Any]:
    """Alternating single requests; milliseconds per request, plus the last answers."""
    progress(f"{title}: {rounds} rounds")
    times: dict[str, list[float]] = {t.name: [] for t in targets}
    answers: dict[str, Any] = {}
    statuses: dict[str, dict[str, int]] = {t.name: {} for t in targets}
    clients = {t.name: KeepAliveClient(t.host, t.port) for t in targets}
    try:
        for i in range(rounds + 2):  # two warm-up rounds
            for t in targets:
                try:
                    resp = clients[t.name].send(raw_request(t, path, body))
                except OSError:
                    statuses[t.name]["error"] = statuses[t.name].get("error", 0) + 1
                    continue
                statuses[t.name][str(resp.status)] = statuses[t.name].get(str(resp.status), 0) + 1
                if resp.status == 200 and i >= 2:
                    times[t.name].append(resp.elapsed_us / 1000)
                    answers[t.name] = orjson.loads(resp.body)
                elif resp.status != 200:
                    answers[t.name] = resp.body[:300].decode(errors="replace")
    finally:
        for c in clients.values():
            c.close()
    out = {t.name: {"ms": spread(times[t.name]), "statuses": statuses[t.name]} for t in targets}
    for t in targets:
        out[t.name]["check"] = check(answers.get(t.name)) if check else None
    report.raw[title] = out
    return out


def rerank_body(model: str, docs: int = 32) -> tuple[bytes, int]:
    texts = sentences(docs, words=40, seed=32)
    match = 17
    texts[match] = "The capital of France is Paris, a city on the river Seine."
    body = {"model": model, "query": "What is the capital of France?", "documents": texts}
    return orjson.dumps(body), match


def rerank_check(answer: Any, match: int) -> str:
    if not isinstance(answer, dict) or not answer.get("results"):
        return f"no results: {str(answer)[:80]}"
    top = answer["results"][0]
    ok = "matching document first" if top.get("index") == match else "WRONG document first"
    return f"{ok} (index {top.get('index')}, score {top.get('relevance_score', 0):.3f})"


def received(engine: Target, path: str = CHAT) -> float | None:
    """Requests for `path` the engine saw (the simulator's counter; None on a real vLLM)."""
    try:
        text = scrape(engine)
    except OSError:
        return None
    found = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sim:received_requests_total" and s.labels.get("path") == path:
                found = (found or 0.0) + s.value
    return found


def ssrf_case(
    report: Report,
    rows_spec: Mapping[str, tuple[Target, Target]],
    model: str,
    canary: RecordingServer,
    counter: Callable[[Target], float | None] = received,
) -> list[dict[str, Any]]:
    """Probe each target with internal URLs as images: status, message, latency, canary.
    `counter` reads what reached an engine (the simulator's counter by default)."""
    table: list[dict[str, Any]] = []
    for name, (target, engine) in rows_spec.items():
        engine_port = engine.port
        probes = {
            "engine /health": f"http://127.0.0.1:{engine_port}/health",
            "engine /metrics": f"http://127.0.0.1:{engine_port}/metrics",
            "file:///etc/passwd": "file:///etc/passwd",
            "canary (metadata path)": f"{canary.url}/latest/meta-data/",
        }
        for probe, url in probes.items():
            body = orjson.dumps(
                {
                    "model": model,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": url}},
                                {"type": "text", "text": "describe"},
                            ],
                        }
                    ],
                    "max_tokens": 4,
                }
            )
            seen, engine_before = canary.connections, counter(engine)
            with KeepAliveClient(target.host, target.port, timeout=60) as c:
                try:
                    resp = c.send(raw_request(target, CHAT, body))
                    status, ms = resp.status, resp.elapsed_us / 1000
                    message = _error_message(resp.body)
                except OSError as exc:
                    status, ms, message = 0, 0.0, f"connection error: {type(exc).__name__}"
            time.sleep(0.05)  # let a late fetch land before reading the canary
            engine_after = counter(engine)
            reached = None
            if engine_after is not None:
                # The simulator's counter has no sample for a path before its first request.
                reached = engine_after > (engine_before or 0.0)
            table.append(
                {
                    "target": name,
                    "probe": probe,
                    "status": status,
                    "message": message,
                    "latency_ms": ms,
                    "canary_contacted": canary.connections > seen,
                    "reached_engine": reached,
                }
            )
    report.table(
        "SSRF probes: internal URLs as image_url",
        ["target", "probe", "status", "message", "latency ms", "reached engine", "canary"],
        [
            [
                r["target"],
                r["probe"],
                r["status"],
                r["message"],
                r["latency_ms"],
                {True: "yes", False: "no", None: "n/a"}[r["reached_engine"]],
                "contacted" if r["canary_contacted"] else "no",
            ]
            for r in table
        ],
        "GPU reference: a default vLLM answered 400 'cannot identify image file' after fetching "
        "/health and /metrics (5.5 ms); with --allowed-media-domains it refused before "
        "fetching (2.6 ms); file:///etc/passwd gave 500.",
    )
    report.raw["ssrf"] = table
    return table


def _error_message(body: bytes) -> str:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:80].decode(errors="replace")
    if isinstance(data, dict) and "error" in data:
        err = data["error"]
        text = err.get("message", "") if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
        return (f"[{code}] " if code else "") + str(text)[:90]
    return "ok (answered)"


def run(cfg: RunConfig, report: Report) -> None:
    rounds = 1 if cfg.quick else 10
    post_rounds = 2 if cfg.quick else 20
    report.meta["pinning"] = cfg.cpus.describe()
    real = cfg.real if isinstance(cfg, RealRunConfig) else None
    # What reached an engine: the simulator's counter, or a real engine's access log.
    counter = received if real is None else lambda t, path=CHAT: real.received(t.url, path)
    with Fleet(cfg.workdir, cfg.cpus) as fleet, RecordingServer() as canary:
        if cfg.external:
            direct = cfg.direct_target(cfg.engine_urls[0])
            gateway = cfg.gateway_target(cfg.gateway_url or "")
            pool_direct, pool_gw = cfg.direct_target(cfg.engine_urls[-1]), gateway
            ssrf_rows = {
                "engine (as deployed)": (direct, direct),
                "gateway": (gateway, direct),
            }
        else:
            strict: Server | None = None
            sim: Server | Engine
            pool: Server | Engine
            if real is not None:
                progress(f"real engines: {real.label}")
                sim, pool = real.generate, real.pooling
            else:
                progress("starting calibrated simulated engines and gateways")
                sim = fleet.sim("--latency", "calibrated", name="sim-generate")
                strict = fleet.sim(
                    "--latency",
                    "calibrated",
                    "--allowed-media-domains",
                    "example.com",
                    name="sim-allowlist",
                )
                pool = fleet.sim(
                    "--latency", "calibrated", "--runner", "pooling", name="sim-pooling"
                )
            gw = fleet.gateway([sim.url])
            # The default gateway refuses every probe on its scheme rule (https only). This
            # one admits http and lists every probed host:port, as an operator might by
            # mistake: what is left to refuse them is the check on the resolved address.
            listed = fleet.gateway(
                [sim.url],
                {
                    "GATEWAY_MEDIA__ALLOWED_SCHEMES": '["http", "https"]',
                    "GATEWAY_MEDIA__ALLOWED_DOMAINS": orjson.dumps(
                        [f"127.0.0.1:{sim.port}", f"127.0.0.1:{canary.port}"]
                    ).decode(),
                },
                name="gateway-listed",
            )
            pgw = fleet.gateway([pool.url], name="gateway-pooling")
            direct = cfg.direct_target(sim.url, sim.pid)
            gateway = cfg.gateway_target(gw.url, gw.pid)
            pool_direct = cfg.direct_target(pool.url, pool.pid)
            pool_gw = cfg.gateway_target(pgw.url, pgw.pid)
            ssrf_rows = {"engine, default": (direct, direct)}
            if strict is not None:
                allowlist = cfg.direct_target(strict.url, strict.pid)
                ssrf_rows["engine, --allowed-media-domains example.com"] = (allowlist, allowlist)
            ssrf_rows["gateway (default settings)"] = (gateway, direct)
            ssrf_rows["gateway (http and the probed hosts allowed)"] = (
                cfg.gateway_target(listed.url, listed.pid, "gateway-listed"),
                direct,
            )
        model = cfg.model or discover_model(direct)
        pool_model = cfg.model or discover_model(pool_direct)
        report.meta["model"], report.meta["pooling_model"] = model, pool_model

        ttft_case(report, direct, gateway, model, rounds)

        def count_embeddings(answer: Any) -> str:
            if not isinstance(answer, dict):
                return f"error: {str(answer)[:80]}"
            usage = answer.get("usage", {})
            return f"{len(answer.get('data', []))} vectors, {usage.get('prompt_tokens')} tokens"

        embed = timed_posts(
            report,
            "embeddings: 64 sentences",
            (pool_direct, pool_gw),
            EMBED,
            embeddings_body(pool_model),
            post_rounds,
            count_embeddings,
        )
        rbody, match = rerank_body(pool_model)
        rerank = timed_posts(
            report,
            "rerank: 1 query, 32 documents",
            (pool_direct, pool_gw),
            "/rerank",
            rbody,
            post_rounds,
            lambda a: rerank_check(a, match),
        )
        rows = []
        for title, res, seed, items in (
            ("embeddings, 64 sentences", embed, SEED_EMBED_MS, 64),
            ("rerank, 1 query + 32 documents", rerank, SEED_RERANK_MS, 32),
        ):
            d, g = res[pool_direct.name]["ms"], res[pool_gw.name]["ms"]
            ratio = g["median"] / d["median"] if d and g else None
            rows.append(
                [
                    title,
                    seed,
                    d.get("median"),
                    g.get("median"),
                    ratio,
                    items / (g["median"] / 1000) if g else None,
                    f"{res[pool_direct.name]['check']} / {res[pool_gw.name]['check']}",
                ]
            )
        report.table(
            "Pooling requests (ms)",
            [
                "request",
                "GPU reference",
                "direct p50",
                "gateway p50",
                "gateway/direct",
                "items/s via gateway",
                "answers direct / gateway",
            ],
            rows,
        )

        progress("SSRF probe table")
        table = ssrf_case(report, ssrf_rows, model, canary, counter)

    gw_rows = [r for r in table if r["target"].startswith("gateway")]
    # Refused means: a 4xx, the canary untouched, and the request never reached the engine
    # (an engine that fetched /health and then failed to decode it also answers 400).
    refused = [
        r
        for r in gw_rows
        if 400 <= r["status"] < 500 and not r["canary_contacted"] and r["reached_engine"] is False
    ]
    report.goal(
        "gateway refuses every SSRF probe before the engine, canary never contacted",
        f"{len(gw_rows)} of {len(gw_rows)} refused",
        f"{len(refused)} of {len(gw_rows)} refused",
        len(refused) == len(gw_rows),
        "" if len(refused) == len(gw_rows) else f"{len(gw_rows) - len(refused)} not refused",
    )
    ttft = report.raw["image_ttft"]["steps"]
    ratios = [v["ratio"] for v in ttft.values() if v["ratio"]]
    if ratios:
        report.note(
            f"image TTFT gateway/direct: median ratio {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}..{max(ratios):.3f})"
        )
        plot_ttft(report, ttft)


def plot_ttft(report: Report, ttft: dict[str, Any]) -> None:
    labels = list(ttft)

    def draw(ax: Any) -> None:
        xs = range(len(labels))
        d = [ttft[k]["direct_ms"].get("median", 0) for k in labels]
        g = [ttft[k]["gateway_ms"].get("median", 0) for k in labels]
        ax.bar([x - 0.2 for x in xs], d, 0.4, label="direct")
        ax.bar([x + 0.2 for x in xs], g, 0.4, label="gateway")
        ax.set_xticks(list(xs), [k.replace(" ", "\n", 1) for k in labels], fontsize=7)
        ax.set_ylabel("time to first token p50, ms")
        ax.set_title("Image requests on a calibrated simulated engine")
        ax.legend()

    report.plot("reference_image_ttft", draw, (9, 4))
