"""Chains of fp32 linears over 128 rows (the demo block's products), per linear: the delegate with
its opt-in CPU linear kernel (each output block's bias added in cache) and without it (MLX's matmul
and a broadcast bias add, the default), and eager torch, in the compiled (normal) run. Each chain is lowered once and loaded twice, one
copy traced with `_runtime.set_linear_kernel(False)`, the other with it on; the three take turns in
blocks of 5 calls, the order rotating. Wall and process CPU time per call, divided by the chain's length.

    python benchmarks/linears.py [--cycles 20] [--shapes ffn,qkv,square]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (imports mlx_delegate first: the BLAS route)
import torch
from common import format_table, heading, machine_meta
from executorch.runtime import Runtime
from torch import nn

from mlx_delegate import _runtime
from mlx_delegate.cli.demo import lower_to_file

# Widths the chain alternates between: d -> h -> d -> ... (4 pairs, 8 linears).
SHAPES = {"ffn": (256, 1024), "qkv": (256, 768), "square": (256, 256)}
ROWS, PAIRS = 128, 4


class Chain(nn.Module):
    def __init__(self, d: int, h: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([m for _ in range(PAIRS) for m in (nn.Linear(d, h, bias=bias),
                                                                       nn.Linear(h, d, bias=bias))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=20, help="blocks of 5 calls per engine")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    args = p.parse_args()
    meta = machine_meta(bandwidth=False)
    torch.manual_seed(0)
    x = torch.randn(1, ROWS, 256)
    rows = []
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            d, h = SHAPES[name]
            for bias in (False, True):
                model = Chain(d, h, bias).eval()
                path = lower_to_file(model, (x,), Path(tmp) / f"{name}-{bias}.pte")
                expected = model(x)
                engines = {}
                for on in (False, True):
                    previous = _runtime.set_linear_kernel(on)
                    program = Runtime.get().load_program(path)
                    method = program.load_method("forward")
                    for _ in range(3):  # traced on the second call, with the switch as set here
                        out = method.execute([x])[0]
                    _runtime.set_linear_kernel(previous)
                    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
                    engines["kernel" if on else "matmul + add"] = (program, method)
                runs = {k: (lambda m=m: m.execute([x])) for k, (_, m) in engines.items()}
                runs["eager torch"] = lambda model=model: model(x)
                wall: dict[str, list[float]] = {k: [] for k in runs}
                cpu: dict[str, list[float]] = {k: [] for k in runs}
                keys = list(runs)
                for cycle in range(args.cycles):
                    # The order rotates: whoever follows eager meets its OpenMP workers still spinning.
                    for k in keys[cycle % len(keys):] + keys[:cycle % len(keys)]:
                        run = runs[k]
                        for _ in range(5):
                            t, c = time.perf_counter(), time.process_time()
                            run()
                            wall[k].append(time.perf_counter() - t)
                            cpu[k].append(time.process_time() - c)
                n = len(model.layers)
                cells = [f"{statistics.median(wall[k]) * 1e6 / n:.0f} / {statistics.median(cpu[k]) * 1e6 / n:.0f}"
                         for k in runs]
                rows.append([f"{ROWS} x {d} <-> {h}", "yes" if bias else "no", *cells])
    print(heading(meta))
    print(format_table(["linears", "bias", "delegate, linear kernel (wall / CPU us)",
                        "delegate, matmul + add", "eager torch"], rows, [False, False, True, True, True]))
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
