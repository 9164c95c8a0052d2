#!/usr/bin/env bash
# The monitoring tier: deploy/monitoring in the real Prometheus (the tests marked
# `prometheus`, left out of the fast suite). promtool checks the alert rules and the
# scrape recipe and runs the rules' unit cases (tests/monitoring/alerts_test.yaml); a
# Prometheus on a free loopback port scrapes a live gateway with a metrics-scope key and
# evaluates every dashboard query and alert rule against it.
# Extra arguments go to pytest.
#
#   bash scripts/test-monitoring.sh      # about half a minute; needs prometheus and promtool
#
# See docs/operations.md.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in prometheus promtool; do
    command -v "$tool" >/dev/null || {
        echo "$tool is not installed (apt-get install prometheus)" >&2
        exit 1
    }
done
bash scripts/setup.sh
.venv/bin/pytest -m prometheus tests/monitoring "$@"
