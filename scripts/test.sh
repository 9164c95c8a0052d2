#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check gateway bench tests
.venv/bin/mypy gateway bench
.venv/bin/pytest "$@"
