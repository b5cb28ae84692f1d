#!/usr/bin/env bash
# Installs zstore and what it needs on a fresh machine.
#   bash tools/setup.sh [EXTRAS]          install only
#   source tools/setup.sh [EXTRAS]        install, then $PY is the Python to run
# Which Python: $PYTHON if set; else the active virtual environment (or conda env); else a
# project environment in .venv at the repository root, created on first use (a
# distribution's own python3 refuses pip installs, PEP 668). torch goes first, pinned to a
# CPU build (torch==2.13.0): a bare "torch" requirement with no torch installed would
# download a multi-GB CUDA build. A second run with the same pyproject.toml and extras
# installs nothing (the C extension is rebuilt when its source changes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
elif [[ -n "${VIRTUAL_ENV:-}" || -n "${CONDA_PREFIX:-}" ]]; then
    PY=python3
else
    if [[ ! -x .venv/bin/python ]]; then
        if ! python3 -m venv .venv >/dev/null 2>.venv-error.log; then
            rm -rf .venv
            echo "error: could not create a virtual environment in $PWD/.venv with $(command -v python3):" >&2
            sed 's/^/  /' .venv-error.log >&2
            rm -f .venv-error.log
            echo "On Debian/Ubuntu install the venv module: apt-get install python3-venv (or python3.X-venv for your version), then rerun; or set PYTHON=/path/to/python to use your own environment." >&2
            exit 2
        fi
        rm -f .venv-error.log
        echo "created the project environment .venv (use it with: source .venv/bin/activate)" >&2
    fi
    PY=$PWD/.venv/bin/python
fi
extras=${1:-}
stamp_dir=$("$PY" -c 'import sys; print(sys.prefix)')
stamp="$stamp_dir/.zstore-setup-$(cat pyproject.toml zstore/read/_stream.c | cksum | cut -d' ' -f1)-${extras:-base}"
if [[ ! -f "$stamp" ]] || ! "$PY" -c "import zstore, torch" 2>/dev/null; then
    if ! "$PY" -c "import torch" 2>/dev/null; then
        "$PY" -m pip install --quiet torch==2.13.0
    fi
    "$PY" -m pip install --quiet -e ".${extras:+[$extras]}"
    touch "$stamp" 2>/dev/null || true
fi
export PY
