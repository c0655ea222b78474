#!/usr/bin/env bash
# Set up from a fresh clone and run the main job: lower a model through the
# MLX delegate, run it with the stock ExecuTorch runtime, print parity and timing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${PYTHON:-python3}" -m mlx_delegate demo "$@"
