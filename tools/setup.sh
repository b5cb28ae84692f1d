#!/usr/bin/env bash
# Installs zstore and what it needs on a fresh machine. Usage: bash tools/setup.sh [EXTRAS]
# torch goes first, pinned to a CPU build (torch==2.13.0): a bare "torch" requirement
# with no torch installed would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0
fi
extras=${1:-}
"$PY" -m pip install --quiet -e ".${extras:+[$extras]}"
