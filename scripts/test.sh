#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check gateway bench tests
.venv/bin/mypy gateway bench
# Two processes, each taking whole test files (their module fixtures stay in one process):
# the suite mostly waits on the servers it starts. TEST_WORKERS=0 runs it in this process.
.venv/bin/pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
