"""`python -m bench.sim --host 127.0.0.1 --port 8001 [options]`: one simulated engine."""

from __future__ import annotations

import uvicorn

from bench.sim.app import SimApp
from bench.sim.config import parse_args


def main() -> None:
    host, port, config = parse_args()
    uvicorn.run(
        SimApp(config),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        # Keep-alive as vLLM's uvicorn default (docs/vllm.md: 5 s).
        timeout_keep_alive=5,
    )


if __name__ == "__main__":
    main()
