"""`mlx-delegate demo`: export a small transformer block, lower it to MLX, run it, check it.

The model is an attention block (matmul/softmax) and an MLP (linear/gelu) with
layer norms, in fp32. Ops that have no handler yet stay on ExecuTorch's CPU
kernels; the inspect summary at the end lists them.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..pipelines.cache import cache_dir
from ._common import CLIError, print_json, progress


@dataclass(frozen=True)
class DemoConfig:
    dim: int = 256
    heads: int = 4
    hidden: int = 1024
    seq: int = 128
    runs: int = 50

    @property
    def tag(self) -> str:
        return f"d{self.dim}-h{self.heads}-f{self.hidden}-t{self.seq}"


QUICK = DemoConfig(dim=32, heads=2, hidden=64, seq=8, runs=3)


class DemoBlock(nn.Module):
    """A pre-norm transformer block with attention written out as matmul + softmax."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.fc1, self.fc2 = nn.Linear(cfg.dim, cfg.hidden), nn.Linear(cfg.hidden, cfg.dim)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="lower a small transformer block to MLX and compare with eager",
                              description=__doc__)
    p.add_argument("--quick", action="store_true", help=f"tiny model and few runs ({QUICK.tag})")
    p.add_argument("--runs", type=int, help="timed runs per backend, interleaved (median is reported)")
    p.add_argument("--atol", type=float, default=1e-3, help="largest acceptable max abs error vs eager")
    p.add_argument("--json", action="store_true", help="machine-readable results")
    p.set_defaults(func=run)


def lower_to_file(model: nn.Module, inputs: tuple, path: Path) -> Path:
    """Export, lower with MLXPartitioner and write the .pte."""
    from executorch.exir import to_edge_transform_and_lower

    from ..partitioner import MLXPartitioner

    progress("exporting")
    ep = torch.export.export(model, inputs, strict=False)
    progress("lowering with MLXPartitioner")
    program = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(program.buffer)
    tmp.replace(path)  # atomic: a concurrent run never loads half a file
    progress(f"saved {path}")
    return path


def interleaved_ms(fns: dict[str, Callable[[], Any]], runs: int, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) milliseconds per call of each engine, timed in turns: one call each per
    round, the order reversed every other round, so load on the machine hits them alike. The
    warm-up calls let the delegate trace its compiled graph (second call) and MLX build its kernels."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for r in range(runs):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            wall, cpu = time.perf_counter(), time.process_time()
            fns[k]()
            times[k].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {k: (statistics.median(t[0] for t in ts) * 1e3, statistics.median(t[1] for t in ts) * 1e3)
            for k, ts in times.items()}


def run(args: argparse.Namespace) -> int:
    from executorch.runtime import Runtime

    from ..inspect import format_summary, inspect_pte

    cfg = QUICK if args.quick else DemoConfig()
    runs = args.runs or cfg.runs
    if runs < 1:
        raise CLIError("--runs must be at least 1")
    torch.manual_seed(0)
    model = DemoBlock(cfg).eval()
    inputs = (torch.randn(1, cfg.seq, cfg.dim),)
    path = lower_to_file(model, inputs, cache_dir() / f"demo-{cfg.tag}.pte")

    progress("loading with executorch.runtime")
    method = Runtime.get().load_program(path).load_method("forward")
    with torch.no_grad():
        expected = model(*inputs)
    actual = method.execute(list(inputs))[0]
    error = (actual - expected).abs().max().item()

    progress(f"timing {runs} runs each")
    with torch.no_grad():
        timed = interleaved_ms({"delegate": lambda: method.execute(list(inputs)), "eager": lambda: model(*inputs)},
                               runs)
    (delegate_ms, delegate_cpu_ms), (eager_ms, eager_cpu_ms) = timed["delegate"], timed["eager"]
    info = inspect_pte(path)
    ok = error <= args.atol
    result = dict(config=asdict(cfg) | {"runs": runs}, pte=str(path), max_abs_error=error, atol=args.atol,
                  parity_ok=ok, delegate_ms=delegate_ms, eager_ms=eager_ms, delegate_cpu_ms=delegate_cpu_ms,
                  eager_cpu_ms=eager_cpu_ms, inspect=info.to_dict())
    if args.json:
        print_json(result)
    else:
        print(f"model: transformer block {cfg.tag}, fp32, input {tuple(inputs[0].shape)}")
        print(f"parity: max abs error {error:.3g} vs eager ({'ok' if ok else 'FAIL'}, atol {args.atol:g})")
        print(f"latency (median of {runs}, interleaved): delegate {delegate_ms:.3f} ms, eager torch {eager_ms:.3f} ms"
              f" (CPU time per call: {delegate_cpu_ms:.3f} ms, {eager_cpu_ms:.3f} ms)")
        print(format_summary(info))
    return 0 if ok else 1
