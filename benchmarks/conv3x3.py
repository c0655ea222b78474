"""ResNet's 3x3 stride-1 convolutions alone: the CPU convolution's im2col path against its Winograd paths.

One `Conv2d(C, C, 3, padding=1)` + ReLU (BatchNorm folded in, as in ResNet-18/50) per shape, at every
3x3 stride-1 shape ResNet-18 and ResNet-50 have (C = 64 at 56x56, 128 at 28x28, 256 at 14x14, 512 at
7x7; ResNet-50's bottleneck 3x3 convolutions have the same shapes), `--residual` adds a residual input
before the ReLU (ResNet-18's second convolution of a block). The program is lowered once and loaded
once per path, each copy compiling its own graph; the copies and eager torch take turns call by call
(wall and the process's CPU time per call, medians). Paths: `im2col` (`_runtime.set_conv_winograd(0)` around its calls),
`F(2x2)` (2), `F(4x4)` (4), `auto` (1, the default: what the gate picks), and eager torch
(`--threads`, default 2). `x im2col`: im2col's median over the row's (wall, CPU). `max|err|`: the path's output
against the convolution in float64, and `tol`: the largest |err| / (atol + rtol |ref|) with the fp32
conv tests' tolerance for K = 9 C products (`mlx_delegate.testing.fp32_tolerance`), which must stay
below 1. Nothing fails here.

    python benchmarks/conv3x3.py [--channels 64,128,256,512] [--batch 1] [--residual] [--threads N]
                                 [--budget S]
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import common
import numpy as np
import torch
from common import Settings, fmt_time, format_table, warm_up
from executorch.runtime import Runtime

from mlx_delegate import _runtime
from mlx_delegate.testing import fp32_tolerance, lower

MAPS = {64: 56, 128: 28, 256: 14, 512: 7}  # ResNet's 3x3 stride-1 shapes at 224x224
PATHS = {"im2col": 0, "F(2x2)": 2, "F(4x4)": 4, "auto": 1}


class ConvRelu(torch.nn.Module):
    def __init__(self, c: int, residual: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(c)
        self.residual = residual

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return torch.relu(y + r if self.residual else y)


def module(c: int, residual: bool) -> torch.nn.Module:
    torch.manual_seed(c)
    m = ConvRelu(c, residual).eval()
    with torch.no_grad():  # a trained network's BatchNorm statistics, not the identity
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    return m


def reference(m: ConvRelu, x: torch.Tensor, r: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return m.double()(x.double(), r.double()).numpy()


def with_mode(method: object, args: list, mode: int) -> object:
    def run() -> object:
        was = _runtime.set_conv_winograd(mode)
        try:
            return method.execute(args)
        finally:
            _runtime.set_conv_winograd(was)

    return run


def interleaved(runs: dict, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds per call, the paths taking turns call by call in a rotating order; CPU is
    the process's CPU time (all threads): on a loaded machine the steadier figure."""
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            t0, c0 = time.perf_counter(), time.process_time()
            runs[k]()
            samples[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", default="64,128,256,512")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--residual", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=2.0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    s = Settings(budget_s=args.budget, max_rounds=200, min_rounds=5)
    rows = []
    for c in (int(v) for v in args.channels.split(",")):
        hw = MAPS.get(c, 14)
        m = module(c, args.residual)
        x = torch.randn(args.batch, c, hw, hw, generator=torch.Generator().manual_seed(1))
        r = torch.randn(args.batch, c, hw, hw, generator=torch.Generator().manual_seed(2))
        ref = reference(m, x, r)
        m = m.float()
        lowered = lower(m, (x, r))
        rtol, atol = fp32_tolerance(9 * c)
        runs, errs, est = {}, {}, {}
        keep = []
        for name, mode in PATHS.items():
            program = Runtime.get().load_program(lowered.buffer)
            keep.append(program)
            run = with_mode(program.load_method("forward"), [x, r], mode)
            out = run()[0].numpy()
            diff = np.abs(out - ref)
            errs[name] = (float(diff.max()), float((diff / (atol + rtol * np.abs(ref))).max()))
            est[name] = warm_up(run, s)
            runs[name] = run
        with torch.no_grad():
            eager = lambda: m(x, r)  # noqa: E731
            diff = np.abs(eager().numpy() - ref)
            errs["eager"] = (float(diff.max()), float((diff / (atol + rtol * np.abs(ref))).max()))
            est["eager"] = warm_up(eager, s)
            runs["eager"] = eager
            gc.disable()
            try:
                samples = interleaved(runs, max(5, min(400, int(args.budget / max(est.values())))))
            finally:
                gc.enable()
        wall = {k: float(np.median([w for w, _ in v])) for k, v in samples.items()}
        cpu = {k: float(np.median([c for _, c in v])) for k, v in samples.items()}
        for k in runs:
            rows.append([f"{c}ch {hw}x{hw} b{args.batch}" if k == "im2col" else "", k,
                         f"{fmt_time(wall[k])} / {fmt_time(cpu[k])}", f"{wall['im2col'] / wall[k]:.2f}x",
                         f"{cpu['im2col'] / cpu[k]:.2f}x", f"{errs[k][0]:.1e}", f"{errs[k][1]:.2f}"])
        del keep
    print(f"load average {os.getloadavg()[0]:.2f}, threads {args.threads}, residual {args.residual}")
    print(format_table(["shape", "path", "wall / CPU", "x im2col", "x im2col CPU", "max|err|", "tol"], rows,
                       [False, False, True, True, True, True, True]))


if __name__ == "__main__":
    main()
