#!/usr/bin/env bash
# The README's test command: set up (a project .venv unless a virtual environment is
# active or $PYTHON is set; torch, then zstore with its test extras) and run the tests that
# fit CI (tests marked "slow" are left out; run them with: pytest -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh test
exec "$PY" -m pytest -m "not slow" -q "$@"
