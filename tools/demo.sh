#!/usr/bin/env bash
# The README's demo command: set up, then generate a small HDF5 file, convert it and read
# random windows through the node cache (see `zstore demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec "${PYTHON:-python3}" -m zstore.cli demo "$@"
