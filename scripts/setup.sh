#!/usr/bin/env bash
# Create .venv with the gateway, the simulator and the test tools. Idempotent: once it
# has installed, it installs again only when pyproject.toml or this script changed (a
# stamp in .venv), instead of asking pip each time (6 s, run by every scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.setup-stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test,bench]"
printf '%s\n' "$want" > "$stamp"
