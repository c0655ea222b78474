#!/usr/bin/env bash
# Rebuild the C++ runtime into the editable install (serialised: several
# developers may share one checkout and one build directory).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore
exec flock /tmp/mlx_delegate-build.lock "${PYTHON:-python3}" -m pip install -q --no-build-isolation --no-deps -e .
