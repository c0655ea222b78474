#!/usr/bin/env bash
# Set up from a fresh clone and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -n 2 -q "$@"
