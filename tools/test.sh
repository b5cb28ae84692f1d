#!/usr/bin/env bash
# The README's test command: set up (a project .venv unless a virtual environment is
# active or $PYTHON is set; torch, then zstore with its test extras), check the package's
# layers (lint-imports), types (mypy) and style (ruff), then run the tests that fit CI
# (tests marked "slow" are left out; run them with: pytest -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh test
bin=$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')
# one command per line: set -e does not stop at a failing command inside an && list
echo "== layers (lint-imports)"
"$bin/lint-imports" --no-cache
echo "== types (mypy)"
"$PY" -m mypy
echo "== style (ruff)"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
exec "$PY" -m pytest -m "not slow" -q "$@"
