#!/usr/bin/env bash
# Install the pinned toolchain and build mlx_delegate (editable) into the current Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q -r requirements-dev.txt
PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-build-isolation -e .
