#!/usr/bin/env bash
# The README's test command: set up (torch, then zstore with its test extras) and run the
# tests that fit CI (tests marked "slow" are left out; run them with: pytest -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
exec "${PYTHON:-python3}" -m pytest -m "not slow" -q "$@"
