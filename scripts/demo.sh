#!/usr/bin/env bash
# The README's first command: set up .venv, then run the gateway in front of two
# simulated engines on loopback, send requests through it, and stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m bench.demo
