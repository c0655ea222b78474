#!/usr/bin/env bash
# Install the pinned toolchain and build mlx_delegate (editable) into the current Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -r requirements-dev.txt
"$PY" -m pip install -q --no-build-isolation -e .
