"""The floor of an image request: what any inspecting proxy must do with it, and no more.

    python -m bench.suites.floor --port PORT --engine URL [--decode]

A plain ASGI app behind the gateway's own server (uvicorn, httptools with the gateway's
connection limits, uvloop, one process) that, per request: reads the body, parses it
(orjson), hashes each `data:` URL's base64 text (sha256, the cache key of a verdict),
writes the body on to the engine unchanged over a kept-alive connection (the gateway's
`Upstream` client) and relays the answer. No key check, no walk, no validation, no
routing. The overhead suite measures it next to the gateway in the same run: the
gateway's added latency over this floor's is what inspection itself costs.

`--decode` adds, for each `data:` URL, decoding its base64 and Pillow's full decode of the
image (open and load), in line on the event loop: the floor of validation at the
gateway's default depth, measured in the same blocks as the gateway instead of summed
from two figures taken apart. Anything the gateway does beyond that (its decode pool, its
checks) counts as the gateway's.

`--allocator gateway` applies the gateway's allocator policy (`tune_allocator`,
gateway/server/process.py: glibc's mmap and trim thresholds fixed), so that a 1.3 MB buffer
costs both processes the same; `default` leaves glibc's sliding thresholds (what that
policy costs, measured).
"""

from __future__ import annotations

import argparse
import hashlib
import io
from collections.abc import Sequence
from typing import Any

import orjson
import pybase64
import uvicorn
from PIL import Image

from gateway.server.process import tune_allocator
from gateway.server.protocol import GatewayProtocol
from gateway.types import Receive, Scope, Send
from gateway.upstream.client import Upstream
from gateway.upstream.origin import Origin


def data_urls(value: Any) -> list[str]:
    """Every string starting with `data:` in a parsed JSON value."""
    found: list[str] = []
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and node.startswith("data:"):
            found.append(node)
    return found


class Floor:
    def __init__(self, engine: str, decode: bool = False) -> None:
        self.origin = Origin(engine)
        self.decode = decode
        self.upstream = Upstream(connect_timeout=5.0, first_byte_timeout=60.0, keepalive=4.0)
        self.hashes = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if scope["method"] == "POST":
            for url in data_urls(orjson.loads(body)):
                text = url.partition(",")[2]
                hashlib.sha256(text.encode("ascii")).digest()
                self.hashes += 1
                if self.decode:
                    with Image.open(io.BytesIO(pybase64.b64decode(text, validate=True))) as im:
                        im.load()
        headers = [(b"content-type", b"application/json")] if body else []
        resp = await self.upstream.request(
            self.origin, scope["method"], scope["path"], headers, body or None
        )
        try:
            answer = await resp.read(60.0)
        finally:
            resp.close()
        await send(
            {
                "type": "http.response.start",
                "status": resp.status,
                "headers": [(b"content-type", resp.content_type.encode("latin-1"))],
            }
        )
        await send({"type": "http.response.body", "body": answer})


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.suites.floor", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine", required=True, help="base URL of the engine")
    p.add_argument("--allocator", choices=("gateway", "default"), default="gateway")
    p.add_argument("--decode", action="store_true", help="also decode each data: image")
    args = p.parse_args(argv)
    if args.allocator == "gateway":
        tune_allocator()
    uvicorn.run(
        Floor(args.engine, args.decode),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=GatewayProtocol,
        access_log=False,
        log_level="warning",
        server_header=False,
        proxy_headers=False,
        lifespan="off",
    )


if __name__ == "__main__":
    main()
