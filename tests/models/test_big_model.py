"""Big-model memory: lowering holds at most one extra copy of the weights, running about one.

Runs `benchmarks/big_model.py` (its own processes, so peaks are not the test worker's) on a
Llama-3.2-1B-shaped model with random fp32 weights. CI runs 2 of its 16 layers (1.5 GB, with the
full vocabulary); `MLX_DELEGATE_BIG_MODEL_LAYERS=16` runs the whole 1.2B model (needs ~11 GB free).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "big_model.py"
EXPORT_PEAK_MAX = 2.3  # the weights + one transient copy while lowering, plus slack for torch/ExecuTorch state
RUN_PEAK_MAX = 1.5  # the weights once (MLX wraps what the runtime read) + transient load buffers
# (measured: 1.37x at 2 layers, 1.01x with all 16)


def over_imports(section: dict, weights: int) -> float:
    return (max(p["peak_bytes"] for p in section["phases"]) - section["imports_bytes"]) / weights


@pytest.mark.slow
def test_big_model_lowers_and_runs_within_memory_bounds(tmp_path):
    layers = os.environ.get("MLX_DELEGATE_BIG_MODEL_LAYERS", "2")
    out = tmp_path / "big.json"
    subprocess.run([sys.executable, str(SCRIPT), "--layers", layers, "--steps", "2", "--json", str(out)],
                   check=True, cwd=SCRIPT.parent, timeout=3000)
    figures = json.loads(out.read_text())
    weights = figures["export"]["weights_bytes"]
    assert figures["export"]["pte_bytes"] >= weights  # every weight is in the file, once
    assert figures["export"]["pte_bytes"] < 1.05 * weights
    assert over_imports(figures["export"], weights) <= EXPORT_PEAK_MAX
    assert over_imports(figures["run"], weights) <= RUN_PEAK_MAX
