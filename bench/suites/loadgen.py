"""Load generation: latency at one connection, time to first chunk, and throughput.

Latency uses a blocking keep-alive socket in a tight loop (thousands of samples, in
microseconds): at one connection Python's own overhead is the same for every target, so
differences between targets are the proxy's. Throughput uses `wrk` when it is installed
(with a Lua script for POST bodies) or a multi-process uvloop generator over raw
keep-alive connections; `choose_generator` measures which one pushes the engine harder.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httptools

from bench.suites.fleet import Target
from bench.suites.report import Report, progress


def raw_request(
    target: Target,
    path: str,
    body: bytes | None = None,
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """One HTTP/1.1 keep-alive request as bytes, ready to write on a socket."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {target.host}:{target.port}"]
    merged = {**target.headers, **(headers or {})}
    if body is not None:
        merged.setdefault("Content-Type", "application/json")
        merged["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in merged.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


# --- one connection ------------------------------------------------------------------


@dataclass
class Response:
    status: int
    body: bytes
    # perf_counter_ns when each piece of body arrived (one entry per socket read).
    pieces: list[tuple[int, bytes]]
    started_ns: int
    done_ns: int

    @property
    def elapsed_us(self) -> float:
        return (self.done_ns - self.started_ns) / 1000


class _Collect:
    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.pieces: list[tuple[int, bytes]] = []
        self.complete = False
        self.keep_alive = True
        self.now = 0
        self.parser: httptools.HttpResponseParser | None = None

    def on_headers_complete(self) -> None:
        # Asked here, while the message is parsed: once it is complete the parser is
        # reset for the next one and says "not keep-alive" for every answer, which made
        # this client open a new connection for every request (every target, so every
        # 1-connection figure carried a connect and an accept per request).
        if self.parser is not None:
            self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, data: bytes) -> None:
        self.body.append(data)
        self.pieces.append((self.now, data))

    def on_message_complete(self) -> None:
        self.complete = True


class _Stale(ConnectionError):
    """The server closed the connection before any byte of the answer."""


class KeepAliveClient:
    """A blocking HTTP/1.1 client over one keep-alive socket (TCP_NODELAY). Close it."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> KeepAliveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, raw: bytes) -> Response:
        """One request and its answer. A kept connection the server closed while it sat
        idle (its keep-alive timeout, uvicorn's 5 s, runs out while other targets take
        their turn) is replaced and the request sent again, as HTTP clients do; the
        time is the second attempt's."""
        reused = self._sock is not None
        try:
            return self._send(raw)
        except _Stale:
            if not reused:
                raise
            return self._send(raw)

    def _send(self, raw: bytes) -> Response:
        sock = self._sock or self._connect()
        collect = _Collect()
        parser = collect.parser = httptools.HttpResponseParser(collect)
        started = time.perf_counter_ns()
        received = False
        try:
            sock.sendall(raw)
            while not collect.complete:
                data = sock.recv(262144)
                collect.now = time.perf_counter_ns()
                if not data:
                    raise ConnectionError("server closed the connection")
                received = True
                parser.feed_data(data)
        except (OSError, httptools.HttpParserError) as exc:
            self.close()
            if not received and isinstance(exc, (ConnectionError, BrokenPipeError)):
                raise _Stale(str(exc)) from exc
            raise
        done = time.perf_counter_ns()
        if not collect.keep_alive:
            self.close()
        return Response(
            parser.get_status_code(), b"".join(collect.body), collect.pieces, started, done
        )


def interleaved_latency(
    runs: Mapping[str, tuple[Target, bytes | Sequence[bytes]]],
    samples: int,
    block: int = 100,
    warmup: int = 200,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Latency in microseconds per target, sampled in alternating blocks (A, B, A, B).

    Every target keeps its own keep-alive connection. A target given several requests
    sends them in turn (one conversation after another). Returns per target the samples,
    status counts and the median of each block (the spread across blocks).
    """
    clients = {name: KeepAliveClient(t.host, t.port) for name, (t, _) in runs.items()}
    raws = {name: itertools.cycle(in_turn(raw)) for name, (_, raw) in runs.items()}
    out: dict[str, dict[str, Any]] = {
        name: {"samples": [], "statuses": {}, "block_medians": [], "errors": 0} for name in runs
    }
    try:
        for name in runs:
            for _ in range(warmup):
                _safe_send(clients[name], next(raws[name]), out[name])
        # Warm-up samples are thrown away.
        for rec in out.values():
            rec["samples"], rec["statuses"], rec["errors"] = [], {}, 0
        rounds = max(1, samples // block)
        for i in range(rounds):
            for name in runs:
                sent = (
                    _safe_send(clients[name], next(raws[name]), out[name]) for _ in range(block)
                )
                block_samples = [us for us in sent if us is not None]
                out[name]["samples"].extend(block_samples)
                if block_samples:
                    out[name]["block_medians"].append(statistics.median(block_samples))
            if progress is not None and (i + 1) % max(1, rounds // 4) == 0:
                progress(f"  {i + 1}/{rounds} rounds")
    finally:
        for c in clients.values():
            c.close()
    return out


def in_turn(raw: bytes | Sequence[bytes]) -> list[bytes]:
    """One request, or several sent in turn, as a list."""
    listed = [raw] if isinstance(raw, bytes) else list(raw)
    if not listed:
        raise ValueError("no request to send")
    return listed


def _safe_send(client: KeepAliveClient, raw: bytes, rec: dict[str, Any]) -> float | None:
    try:
        resp = client.send(raw)
    except (OSError, httptools.HttpParserError):
        rec["errors"] += 1
        rec["statuses"]["error"] = rec["statuses"].get("error", 0) + 1
        return None
    key = str(resp.status)
    rec["statuses"][key] = rec["statuses"].get(key, 0) + 1
    return resp.elapsed_us


@dataclass
class StreamTiming:
    status: int
    first_chunk_us: float
    gaps_us: list[float]
    frames: int


def stream_timing(client: KeepAliveClient, raw: bytes) -> StreamTiming:
    """Time to the first SSE `data:` frame and the gaps between later frames.

    Frames that arrive in one socket read get the same arrival time (a gap of 0).
    """
    resp = client.send(raw)
    times: list[int] = []
    for at, piece in resp.pieces:
        times.extend([at] * piece.count(b"data:"))
    if not times:
        return StreamTiming(resp.status, resp.elapsed_us, [], 0)
    first = (times[0] - resp.started_ns) / 1000
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(times)]
    return StreamTiming(resp.status, first, gaps, len(times))


# --- throughput ----------------------------------------------------------------------


@dataclass
class LoadResult:
    """One throughput run. `duration_s` is the elapsed time the generator measured, not
    the window it was asked for: a loaded machine or a slow target stretches a run past
    its window, and a rate over the window would overstate what was served."""

    generator: str
    connections: int
    duration_s: float
    requests: int
    errors: int
    statuses: dict[str, int] = field(default_factory=dict)
    p50_us: float = 0.0
    p99_us: float = 0.0
    cpu_s: float | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def error_rate(self) -> float:
        total = self.requests + self.errors
        return self.errors / total if total else 0.0

    @property
    def cpu_us_per_request(self) -> float | None:
        if self.cpu_s is None or not self.requests:
            return None
        return self.cpu_s / self.requests * 1e6

    def as_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator,
            "connections": self.connections,
            "duration_s": round(self.duration_s, 3),
            "requests": self.requests,
            "errors": self.errors,
            "statuses": self.statuses,
            "rps": round(self.rps, 1),
            "p50_us": round(self.p50_us, 1),
            "p99_us": round(self.p99_us, 1),
            "cpu_s": self.cpu_s,
            "cpu_us_per_request": self.cpu_us_per_request,
        }


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


WRK_SCRIPT = """\
local bodies = {{}}
for i, path in ipairs({{{bodies}}}) do
  local f = assert(io.open(path, "rb"))
  bodies[i] = f:read("*all")
  f:close()
end
wrk.method = "{method}"
wrk.body = bodies[1]
{headers}
-- One body: wrk's own request, built once (a request() function costs wrk a Lua call a
-- request). Several: each thread sends them in turn.
if #bodies > 1 then
  local sent = 0
  request = function()
    sent = sent % #bodies + 1
    return wrk.format(nil, nil, nil, bodies[sent])
  end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50":%f,"p99":%f}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class Load:
    """A throughput run: `connections` keep-alive connections sending `body` to `path`
    for `duration` seconds, driven by one thread or process per usable CPU. Several
    bodies (a tuple) are shared out: connection i sends body i modulo their number (the
    Python generator), or each wrk thread sends them in turn."""

    path: str
    body: bytes | tuple[bytes, ...]
    connections: int
    duration: float
    method: str = "POST"

    @property
    def bodies(self) -> list[bytes]:
        return in_turn(self.body)

    @property
    def workers(self) -> int:
        return max(1, min(len(os.sched_getaffinity(0)), self.connections))


def run_wrk(target: Target, load: Load) -> LoadResult:
    """Throughput with wrk. wrk counts non-2xx/3xx answers as `status` errors."""
    path, connections, duration = load.path, load.connections, load.duration
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
        paths = []
        for i, body in enumerate(load.bodies):
            paths.append(Path(tmp) / f"body-{i}")
            paths[-1].write_bytes(body)
        headers = {"Content-Type": "application/json", **target.headers}
        header_lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        script = Path(tmp) / "req.lua"
        script.write_text(
            WRK_SCRIPT.format(
                bodies=", ".join(f'"{p}"' for p in paths),
                method=load.method,
                headers=header_lines,
            )
        )
        args = [
            "wrk", "-t", str(load.workers), "-c", str(connections),
            "-d", f"{max(1, round(duration))}s", "--timeout", "10s",
            "-s", str(script), target.url + path,
        ]  # fmt: skip
        proc = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr[-500:]}")
    data = json.loads(line.removeprefix("WRKJSON "))
    socket_errors = data["connect"] + data["read"] + data["write"] + data["timeout"]
    ok = data["requests"] - data["status"]
    return LoadResult(
        "wrk",
        connections,
        data["duration_us"] / 1e6,
        ok,
        data["status"] + socket_errors,
        {"non_2xx": data["status"], "socket_errors": socket_errors},
        data["p50"],
        data["p99"],
    )


class _LoadConn:
    """One keep-alive connection of the Python generator, as an asyncio protocol."""

    def __init__(self, raw: bytes, stats: _WorkerStats, stop_at: float, done: Any) -> None:
        self.raw, self.stats, self.stop_at, self.done = raw, stats, stop_at, done
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.sent = 0.0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fire(self) -> None:
        self.sent = time.perf_counter()
        self.transport.write(self.raw)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.stats.errors += 1
            self.transport.close()

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        status = self.parser.get_status_code()
        if 200 <= status < 300:
            self.stats.latencies.append((now - self.sent) * 1e6)
        else:
            self.stats.non_2xx += 1
        self.stats.statuses[str(status)] = self.stats.statuses.get(str(status), 0) + 1
        if now < self.stop_at:
            self.fire()
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if time.perf_counter() < self.stop_at:
            self.stats.errors += 1
        if not self.done.done():
            self.done.set_result(None)

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass


@dataclass
class _WorkerStats:
    latencies: array[float] = field(default_factory=lambda: array("d"))
    statuses: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    non_2xx: int = 0
    # perf_counter when the worker fired its first requests and when its last
    # connection ended (CLOCK_MONOTONIC: comparable across the worker processes).
    span: tuple[float, float] = (0.0, 0.0)


def elapsed(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds from the first worker's start to the last worker's end."""
    if not spans:
        return 0.0
    return max(end for _, end in spans) - min(start for start, _ in spans)


def _load_worker(
    conn: Connection, host: str, port: int, raws: list[bytes], duration: float
) -> None:
    """One process of the Python generator: a connection per request in `raws`."""
    import asyncio

    import uvloop

    async def main() -> _WorkerStats:
        loop = asyncio.get_running_loop()
        stats = _WorkerStats()
        protos: list[_LoadConn] = []
        for raw in raws:
            done = loop.create_future()
            proto = _LoadConn(raw, stats, float("inf"), done)
            await loop.create_connection(lambda p=proto: p, host, port)  # type: ignore[misc]
            protos.append(proto)
        conn.send("ready")
        conn.recv()  # go
        started = time.perf_counter()
        stop_at = started + duration
        for p in protos:
            p.stop_at = stop_at
            p.fire()
        await asyncio.wait([p.done for p in protos], timeout=duration + 30)
        stats.span = (started, time.perf_counter())
        return stats

    stats = uvloop.run(main())
    conn.send((stats.latencies.tobytes(), stats.statuses, stats.errors, stats.non_2xx, stats.span))
    conn.close()


def run_python(target: Target, load: Load) -> LoadResult:
    """Throughput with the multi-process uvloop generator (raw keep-alive connections)."""
    connections, duration, processes = load.connections, load.duration, load.workers
    bodies = [raw_request(target, load.path, body, load.method) for body in load.bodies]
    raws = [bodies[i % len(bodies)] for i in range(connections)]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    share = [connections // processes + (i < connections % processes) for i in range(processes)]
    for first, n in zip(itertools.accumulate([0, *share]), share, strict=False):
        parent, child = ctx.Pipe()
        mine = raws[first : first + n]
        proc = ctx.Process(
            target=_load_worker, args=(child, target.host, target.port, mine, duration)
        )
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        for p in pipes:
            if not p.poll(60) or p.recv() != "ready":
                raise RuntimeError("load generator worker did not start")
        for p in pipes:
            p.send("go")
        results = [p.recv() if p.poll(duration + 60) else None for p in pipes]
    finally:
        for p in pipes:
            p.close()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    latencies: array[float] = array("d")
    statuses: dict[str, int] = {}
    errors = non_2xx = 0
    spans: list[tuple[float, float]] = []
    for res in results:
        if res is None:
            errors += 1
            continue
        spans.append(res[4])
        lat = array("d")
        lat.frombytes(res[0])
        latencies.extend(lat)
        for k, v in res[1].items():
            statuses[k] = statuses.get(k, 0) + v
        errors += res[2]
        non_2xx += res[3]
    ordered = sorted(latencies)
    return LoadResult(
        "python",
        connections,
        elapsed(spans),
        len(ordered),
        errors + non_2xx,
        statuses,
        percentile(ordered, 50),
        percentile(ordered, 99),
    )


Generator = Callable[[Target, Load], LoadResult]


def generator_named(name: str) -> Generator:
    if name == "wrk":
        return run_wrk
    if name == "python":
        return run_python
    raise ValueError(f"unknown load generator {name!r}")


def choose_generator(target: Target, load: Load) -> tuple[str, dict[str, float]]:
    """Measure each available generator against `target` (the engine itself) and return
    the one that drives it harder, with the request rates seen."""
    rates = {"python": run_python(target, load).rps}
    if wrk_available():
        rates["wrk"] = run_wrk(target, load).rps
    return max(rates, key=lambda k: rates[k]), rates


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values (0.0 for none)."""
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, math.ceil(pct / 100 * len(ordered)) - 1))
    return float(ordered[index])


def select(
    choice: str, target: Target, path: str, body: bytes, quick: bool, report: Report
) -> Generator:
    """The generator named by `choice`, or for "auto" the one that drives `target` (the
    engine, direct) harder at 64 connections; the choice and the rates go in the report."""
    if choice == "auto":
        progress("choosing the load generator: each drives the engine directly")
        choice, rates = choose_generator(target, Load(path, body, 64, 1.0 if quick else 3.0))
        report.note(
            f"load generator: {choice} (direct to the engine at 64 connections: "
            + ", ".join(f"{k} {v:,.0f} req/s" for k, v in rates.items())
            + ")"
        )
    report.meta["load_generator"] = choice
    return generator_named(choice)
