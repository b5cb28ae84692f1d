#!/usr/bin/env bash
# The README's demo command: set up (see tools/setup.sh), then generate a small HDF5 file,
# convert it and read random windows through the node cache (see `zstore demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh ""  # no extras (and not the demo's own arguments)
exec "$PY" -m zstore.cli demo "$@"
