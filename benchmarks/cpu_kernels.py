"""Op-level timings of the CPU element-wise / row kernels against MLX's own ops
(MLX_DELEGATE_CPU_KERNELS=0) and eager torch, at the shapes SmolLM2-135M prefill
(32 and 128 tokens) and the Whisper-base encoder (1500 frames) run.

Each op is lowered once on its own; two worker processes (kernels on and off)
load the same programs and take turns round by round, so load on the shared
machine hits both alike. Figures are medians over rounds of the per-round median
call time; eager torch runs in this process with 2 threads. Nothing fails here.

    python benchmarks/cpu_kernels.py [--rounds 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import mlx_delegate  # noqa: F401  (before mlx, as in the other benchmarks)
from mlx_delegate.testing import Lambda, lower

warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)

Op = Callable[[torch.Tensor], torch.Tensor]


def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), torch.ones(x.shape[-1]), 1e-5)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), torch.ones(x.shape[-1]), torch.zeros(x.shape[-1]), 1e-5)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


# (label, op, shape): SmolLM2-135M (hidden 576, MLP 1536, 9 heads), Whisper base (512, 2048, 8 heads).
CASES: list[tuple[str, Op, tuple[int, ...]]] = [
    ("smollm2 s32 rms_norm", rms, (32, 576)),
    ("smollm2 s32 silu", F.silu, (32, 1536)),
    ("smollm2 s32 softmax", softmax, (9, 32, 32)),
    ("smollm2 s128 rms_norm", rms, (128, 576)),
    ("smollm2 s128 silu", F.silu, (128, 1536)),
    ("smollm2 s128 softmax", softmax, (9, 128, 128)),
    ("whisper layer_norm", layer_norm, (1500, 512)),
    ("whisper gelu", F.gelu, (1500, 2048)),
    ("whisper softmax", softmax, (8, 1500, 1500)),
    ("exp 16M", torch.exp, (1 << 24,)),
]

WORKER = """
import json, sys, time, statistics, torch
import mlx_delegate  # registers the backend
from executorch.runtime import Runtime
saved, calls = sys.argv[1], int(sys.argv[2])
times = {}
for label, buffer, x in torch.load(saved):
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    for _ in range(2):
        method.execute([x])  # the second call compiles the graph
    samples = []
    for _ in range(calls):
        t = time.perf_counter(); method.execute([x]); samples.append(time.perf_counter() - t)
    times[label] = statistics.median(samples)
print(json.dumps(times))
"""


def time_worker(saved: Path, kernels: str, calls: int) -> dict[str, float]:
    env = {**os.environ, "MLX_DELEGATE_CPU_KERNELS": kernels}
    done = subprocess.run([sys.executable, "-c", WORKER, str(saved), str(calls)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"worker (kernels={kernels}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_eager(op: Op, x: torch.Tensor, calls: int) -> float:
    op(x)
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        op(x)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    inputs = {label: torch.randn(shape) for label, _, shape in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "ops.pt"
        torch.save([(label, lower(Lambda(op), (inputs[label],)).buffer, inputs[label]) for label, op, _ in CASES],
                   saved)
        rounds: dict[str, list[dict[str, float]]] = {"on": [], "off": [], "eager": []}
        for _ in range(args.rounds):
            rounds["on"].append(time_worker(saved, "1", args.calls))
            rounds["off"].append(time_worker(saved, "0", args.calls))
            rounds["eager"].append({label: time_eager(op, inputs[label], args.calls) for label, op, _ in CASES})
    print(f"{'op':24s} {'shape':>16s} {'kernels on':>12s} {'MLX (off)':>12s} {'eager torch':>12s} {'speed-up':>9s}")
    for label, _, shape in CASES:
        on, off, eager = (statistics.median(r[label] for r in rounds[k]) * 1e3 for k in ("on", "off", "eager"))
        print(f"{label:24s} {str(shape):>16s} {on:10.3f}ms {off:10.3f}ms {eager:10.3f}ms {off / on:8.1f}x")


if __name__ == "__main__":
    main()
