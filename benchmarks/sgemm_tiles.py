"""The single-threaded fp32 gemm that serves the pool's product blocks (`_blas.serial_sgemm`), per kind:
torch's MKL and the BLAS front's own AVX2 and AVX-512 register tiles (cpp/sgemm_x86.cpp), beside
`torch.mm` on one thread. Convolution-, ViT- and small-map-shaped products; the kinds take turns in one
process (rounds rotating the order), best of the rounds, GFLOP/s. The default kind
(`_blas.sgemm_kind()` at start-up) is the one this table should justify on the machine it runs on.

    python benchmarks/sgemm_tiles.py [--rounds 3] [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import common  # noqa: F401  (first: mlx_delegate before mlx)
import numpy as np
import torch

from mlx_delegate import _blas

# (m, n, k): ResNet 3x3 at 56x56 and 28x28 (im2col), a 7x7 map's 3x3 (few columns: computed transposed),
# a 1x1 at 14x14, ViT-B/16's FFN and its batch-8 QKV-sized product.
SHAPES = ((64, 3136, 576), (128, 784, 1152), (512, 49, 4608), (1024, 196, 256), (197, 3072, 768),
          (1576, 768, 768))


def gflops(f: Callable[[], object], flop: float, seconds: float) -> float:
    f()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        f()
        n += 1
    return flop * n / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.3, help="timed seconds per kind, shape and round")
    args = p.parse_args()
    default = _blas.sgemm_kind()
    kinds = []
    for kind in ("mkl", "avx2", "avx512"):  # those this processor runs (a wider tile falls back)
        _blas.set_sgemm_kind(kind)
        if _blas.sgemm_kind() == kind:
            kinds.append(kind)
    _blas.set_sgemm_kind(default)
    torch.set_num_threads(1)
    meta = common.machine_meta(bandwidth=False) | {"default": default}
    print(", ".join(f"{k}={v}" for k, v in meta.items()))
    cols = [*kinds, "torch.mm"]
    print("| m x n x k | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    rng = np.random.default_rng(0)
    for m, n, k in SHAPES:
        a, b = rng.random((m, k), np.float32), rng.random((k, n), np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        best = dict.fromkeys(cols, 0.0)
        for r in range(args.rounds):
            order = cols[r % len(cols):] + cols[:r % len(cols)]
            for kind in order:
                if kind == "torch.mm":
                    f: Callable[[], object] = lambda: torch.mm(ta, tb)  # noqa: E731
                else:
                    _blas.set_sgemm_kind(kind)
                    f = lambda: _blas.serial_sgemm(a, b)  # noqa: E731
                best[kind] = max(best[kind], gflops(f, 2.0 * m * n * k, args.seconds))
        _blas.set_sgemm_kind(default)
        print(f"| {m} x {n} x {k} | " + " | ".join(f"{best[c]:.1f}" for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
