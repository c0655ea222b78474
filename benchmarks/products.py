"""One fp32 product of the demo block's shapes through the BLAS front (`cblas_sgemm` of
libmlxd_blas.so, called directly, so no MLX graph or hand-off is timed) cut in different ways, against
eager torch's `F.linear` (MKL on its 2-thread OpenMP team) and one single-threaded MKL call
(`mlxd_sgemm_serial`), interleaved call by call: split shapes (`_blas.set_split_shape`: blocks per
pool thread, axis) and, with `--omp`, one MKL call on the calling thread's OpenMP team (split policy
"never"). `--balanced` adds the balanced split (policy "balanced": the calling thread's block sized by
the helpers' measured speed). `--gap-us N` idles N us (a busy wait on the calling thread) before each
call, so the pool's helpers have gone to sleep (they spin 100 us after a job) and each split product
starts with a wake-up, as the first product of a call does. Medians in microseconds.

    python benchmarks/products.py [--reps 300] [--omp] [--balanced] [--gap-us 300]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import common  # noqa: F401  (imports mlx_delegate first: the BLAS route)
import torch
from common import format_table, heading, machine_meta

from mlx_delegate import _blas

SHAPES = ((128, 256, 768), (128, 256, 256), (128, 256, 1024), (128, 1024, 256))  # M x K x N: QKV, out, FFN in/out
SPLITS = {"2 / thread, longer axis": (2, "longer"), "1 / thread, longer axis": (1, "longer"),
          "1 / thread, rows": (1, "rows"), "2 / thread, rows": (2, "rows")}


def calls(sgemm: Any, serial: Any, modes: dict[str, tuple[str, tuple[int, str]]], x: torch.Tensor,
          w: torch.Tensor, c: torch.Tensor) -> dict[str, Callable[[], object]]:
    """c = x @ w^T (row-major) each way: through the front under each mode, one serial MKL call, eager."""
    (m, k), n = x.shape, w.shape[0]
    fp = ctypes.POINTER(ctypes.c_float)
    px, pw, pc = (ctypes.cast(t.data_ptr(), fp) for t in (x, w, c))

    def split(policy: str, shape: tuple[int, str]) -> Callable[[], object]:
        def run() -> None:
            previous, was = _blas.set_split_policy(policy), _blas.set_split_shape(*shape)
            sgemm(101, 111, 112, m, n, k, 1.0, px, k, pw, k, 0.0, pc, n)  # CblasRowMajor, NoTrans, Trans
            _blas.set_split_policy(previous)
            _blas.set_split_shape(*was)
        return run

    runs: dict[str, Callable[[], object]] = {name: split(*mode) for name, mode in modes.items()}
    runs["one single-threaded call"] = lambda: serial(0, 1, m, n, k, 1.0, px, k, pw, k, 0.0, pc, n)
    runs["eager F.linear"] = lambda: torch.nn.functional.linear(x, w)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--omp", action="store_true", help="also one MKL call on its OpenMP team")
    p.add_argument("--balanced", action="store_true", help="also the balanced split (1 block per thread)")
    p.add_argument("--gap-us", type=float, default=0.0, help="busy-wait this long before each call")
    args = p.parse_args()
    lib = _blas._state["lib"]
    if lib is None:
        raise SystemExit("needs the BLAS front (Linux, MLX_DELEGATE_BLAS not 'reference')")
    meta = machine_meta(bandwidth=False)
    fp = ctypes.POINTER(ctypes.c_float)
    sgemm, serial = lib.cblas_sgemm, lib.mlxd_sgemm_serial
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, fp, ctypes.c_int, fp, ctypes.c_int, ctypes.c_float, fp,
                                           ctypes.c_int]
    serial.argtypes = [ctypes.c_int] * 5 + [ctypes.c_float, fp, ctypes.c_int, fp, ctypes.c_int, ctypes.c_float, fp,
                                            ctypes.c_int]
    modes = {name: ("always", shape) for name, shape in SPLITS.items()}
    if args.omp:
        modes["MKL OpenMP team"] = ("never", (1, "longer"))
    if args.balanced:
        modes["balanced, 1 / thread"] = ("balanced", (1, "longer"))
    rows = []
    for m, k, n in SHAPES:
        x, w, c = torch.randn(m, k), torch.randn(n, k), torch.empty(m, n)
        runs = calls(sgemm, serial, modes, x, w, c)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.reps):
            for name, run in runs.items():
                t = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t)
                if args.gap_us:  # a busy wait: a sleep would hand the core to whatever else is runnable
                    until = time.perf_counter() + args.gap_us * 1e-6
                    while time.perf_counter() < until:
                        pass
        runs[next(iter(SPLITS))]()
        torch.testing.assert_close(c, x @ w.T, rtol=1e-4, atol=1e-3)
        rows.append([f"{m} x {k} x {n}", *(f"{statistics.median(v) * 1e6:.0f}" for v in times.values())])
    print(heading(meta))
    print(format_table(["M x K x N", *runs], rows, [False] + [True] * len(runs)))
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
