"""`python -m bench.suites.decode_memory`: the gateway's memory under decode-heavy requests.

Requests of `--images` solid-colour RGBA PNGs (or `--format`
progressive JPEGs or WebPs, the costliest kinds to decode) as base64 `data:` URLs, just
under the pixel cap, `--requests` of them at once, through the gateway in
front of a simulated engine. Reports the gateway's peak RSS (VmHWM of /proc/<pid>/status),
its RSS before and after, the statuses, and whether it still answers /healthz and a
normal request. `--env NAME=VALUE` (repeatable) sets the gateway's environment
(GATEWAY_MEDIA__..., MALLOC_ARENA_MAX...), so variants are compared in one run.

    python -m bench.suites.decode_memory                    # defaults: 4095 x 4095 RGBA PNGs
    python -m bench.suites.decode_memory --format webp --repeat 2
    python -m bench.suites.decode_memory --env MALLOC_ARENA_MAX=2
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

import httpx

from bench.harness.samples import data_url, encode, png_chunk
from bench.harness.server import Server, clean_env, free_port
from gateway.media.settings import MediaSettings

KEY = "sk-decode-memory-0123456789abcdef"
MODEL = "Qwen/Qwen3-VL-2B-Instruct"
# Room for 8 images at the simulator's 16,384 tokens each, so the engine answers 200.
SIM_CONTEXT = 262_144


@cache
def solid_png(side: int, mode: str = "RGBA") -> bytes:
    """A solid-colour `side` x `side` PNG (a 6324 x 6324 RGBA one is ~165 KB)."""
    from PIL import Image

    colour = (10, 20, 30, 255) if mode == "RGBA" else (10, 20, 30)
    return encode(Image.new(mode, (side, side), colour), "PNG")


def solid_images(side: int, fmt: str, count: int) -> list[tuple[str, bytes]]:
    """`count` solid-colour images of distinct bytes: (MIME type, bytes). PNGs share one
    encoding, told apart by a tEXt chunk; JPEG (progressive) and WebP are encoded once
    per colour."""
    from PIL import Image

    if fmt == "png":
        return [
            ("image/png", tagged(solid_png(side), f"{i}-{time.time_ns()}")) for i in range(count)
        ]
    out = []
    for i in range(count):
        image = Image.new("RGB", (side, side), (i % 256, (i * 7 + time.time_ns()) % 256, 30))
        if fmt == "jpeg":
            buf = io.BytesIO()
            image.save(buf, "JPEG", quality=90, progressive=True)
            out.append(("image/jpeg", buf.getvalue()))
        else:
            out.append(("image/webp", encode(image, "WEBP")))
    return out


def tagged(png: bytes, tag: str) -> bytes:
    """`png` with a tEXt chunk carrying `tag` before its IEND: distinct bytes (no cache
    hit in the gateway) for the same decoding cost, without encoding the image again.
    After the image data, the chunk leaves the check to Pillow's full decode (the
    gateway's own PNG check passes only IDAT followed by IEND, gateway/media/png.py):
    the decode a sender can always ask for, which is what memory is measured under."""
    iend = len(png) - 12  # Pillow writes IEND last, 12 bytes
    return png[:iend] + png_chunk(b"tEXt", b"nonce\x00" + tag.encode("ascii")) + png[iend:]


def just_under(pixels: int) -> int:
    """The side of the largest square image with fewer than `pixels` pixels."""
    side = math.isqrt(pixels)
    return side - 1 if side * side >= pixels else side


def chat_body(images: Sequence[bytes | tuple[str, bytes]]) -> dict[str, object]:
    """A chat request with these images (PNG bytes, or MIME type and bytes) as data URLs."""
    typed = [img if isinstance(img, tuple) else ("image/png", img) for img in images]
    content: list[dict[str, object]] = [
        {"type": "image_url", "image_url": {"url": data_url(mime, img)}} for mime, img in typed
    ]
    content.append({"type": "text", "text": "What is in these images?"})
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def normal_body() -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}


def status_kib(pid: int, field_name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise KeyError(field_name)


@dataclass
class Outcome:
    env: dict[str, str]
    format: str
    side: int
    images: int
    requests: int
    request_mib: float
    rss_before_mib: float = 0.0
    hwm_before_mib: float = 0.0
    peak_mib: float = 0.0  # VmHWM after the requests
    rss_after_mib: float = 0.0  # VmRSS 2 s after the last answer
    seconds: float = 0.0
    answers: list[tuple[int, str | None]] = field(default_factory=list)
    healthz: int = 0
    normal: int = 0


def post(url: str, body: dict[str, object]) -> tuple[int, str | None]:
    headers = {"Authorization": f"Bearer {KEY}"}
    resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    code = None
    if resp.status_code != 200:
        code = resp.json().get("error", {}).get("code")
    return resp.status_code, code


def measure(
    side: int, images: int, requests: int, env: dict[str, str], workdir: Path, fmt: str = "png"
) -> Outcome:
    made = solid_images(side, fmt, images * requests)
    bodies = [chat_body(made[r * images : (r + 1) * images]) for r in range(requests)]
    size = len(json.dumps(bodies[0]))
    sim_port, gw_port = free_port(), free_port()
    sim = Server(
        "sim",
        [sys.executable, "-m", "bench.sim", "--host", "127.0.0.1", "--port", str(sim_port),
         "--latency", "zero", "--max-model-len", str(SIM_CONTEXT),
         "--kv-cache-tokens", str(4 * SIM_CONTEXT)],
        sim_port,
        workdir / f"sim-{sim_port}.log",
    )  # fmt: skip
    gw_env = {
        "GATEWAY_ENGINES": json.dumps([sim.url]),
        "GATEWAY_API_KEYS": json.dumps([KEY]),
        **env,
    }
    gateway = Server(
        "gateway",
        [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1",
         "--port", str(gw_port)],
        gw_port,
        workdir / f"gateway-{gw_port}.log",
        env=clean_env(gw_env),
    )  # fmt: skip
    out = Outcome(env, fmt, side, images, requests, size / 2**20)
    try:
        sim.start("/health")
        gateway.start("/readyz")
        assert gateway.pid is not None
        pid = gateway.pid
        assert post(gateway.url, normal_body())[0] == 200  # warm: imports, connections
        out.rss_before_mib = status_kib(pid, "VmRSS") / 1024
        out.hwm_before_mib = status_kib(pid, "VmHWM") / 1024
        start = time.monotonic()
        with ThreadPoolExecutor(requests) as pool:
            out.answers = list(pool.map(lambda b: post(gateway.url, b), bodies))
        out.seconds = time.monotonic() - start
        out.peak_mib = status_kib(pid, "VmHWM") / 1024
        time.sleep(2.0)
        out.rss_after_mib = status_kib(pid, "VmRSS") / 1024
        out.healthz = httpx.get(gateway.url + "/healthz", timeout=10).status_code
        out.normal = post(gateway.url, normal_body())[0]
    finally:
        gateway.stop()
        sim.stop()
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.suites.decode_memory", description=__doc__)
    p.add_argument("--side", type=int, help="image side (default: just under --pixels)")
    p.add_argument(
        "--pixels",
        type=int,
        default=MediaSettings().max_pixels,
        help="the pixel cap to stay under (default: the gateway's default; 40000000 before)",
    )
    p.add_argument("--format", choices=("png", "jpeg", "webp"), default="png",
                   help="RGBA PNG, progressive JPEG or WebP")  # fmt: skip
    p.add_argument("--images", type=int, default=8, help="images per request")
    p.add_argument("--requests", type=int, default=2, help="requests sent at once")
    p.add_argument("--repeat", type=int, default=1, help="runs per variant (fresh gateways)")
    p.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="gateway environment"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    side = args.side or just_under(args.pixels)
    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory(prefix="decode-memory-") as tmp:
        for _ in range(args.repeat):
            out = measure(side, args.images, args.requests, env, Path(tmp), args.format)
            print(json.dumps(asdict(out)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
