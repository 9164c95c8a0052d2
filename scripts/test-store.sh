#!/usr/bin/env bash
# The shared-store tier: the routing tests that need redis-server (marked `redis`, left out
# of the fast suite): two gateway replicas sharing placements through Redis, Redis frozen,
# stopped and back; and deploy/k8s/routing-tier-store's Redis (its arguments and example
# ACL) behind the tier's gateway. Each module starts its own redis-server on a free
# loopback port.
# Extra arguments go to pytest.
#
#   bash scripts/test-store.sh           # about a minute; needs redis-server on PATH
#
# See docs/routing.md, "The shared store".
set -euo pipefail
cd "$(dirname "$0")/.."
command -v redis-server >/dev/null || {
    echo "redis-server is not installed (apt-get install redis-server)" >&2
    exit 1
}
bash scripts/setup.sh
.venv/bin/pytest -m redis tests/store "$@"
