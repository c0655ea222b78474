"""torch's MKL sgemm, y = x w^T, cut the ways the fp32 linear kernel can cut it, against one call on MKL's own
OpenMP team (`torch.mm`): two Python threads each run one single-threaded block (ctypes releases the GIL),
by rows, by columns, and by rows on a weight packed once (`cblas_sgemm_pack` / `cblas_sgemm_compute`: tried
in the linear kernel on 2026-11-26, no gain, not kept; docs/performance.md). Interleaved rounds in one process; median wall and process CPU per
call, and each cut's speed relative to `torch.mm` (above 1.00x faster).

    python benchmarks/sgemm_split.py [--rows 1576,128] [--rounds 10]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072))  # (N, K): a ViT / BERT-base layer's linears
ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162
P = ctypes.POINTER(ctypes.c_float)


def _ptr(a: np.ndarray, offset: int = 0) -> ctypes._Pointer:
    return ctypes.cast(a.ctypes.data + 4 * offset, P)


def _int(v: int) -> ctypes._CArgObject:
    return ctypes.byref(ctypes.c_int(v))


def _float(v: float) -> ctypes._CArgObject:
    return ctypes.byref(ctypes.c_float(v))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1576,128", help="comma-separated row counts M")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(2)
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P]
    lib.cblas_sgemm_compute.argtypes = [ctypes.c_int] * 6 + [P, ctypes.c_int, P, ctypes.c_int, ctypes.c_float,
                                                             P, ctypes.c_int]
    pool = ThreadPoolExecutor(2)
    one = ctypes.c_int(1)  # each pool thread's MKL calls single-threaded, as mlxd_sgemm_serial makes them
    list(pool.map(lambda _: lib.mkl_set_num_threads_local_(ctypes.byref(one)), range(2)))
    print(f"load {os.getloadavg()}")
    for m in (int(r) for r in args.rows.split(",")):
        for n, k in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            xn, wn, y = x.numpy(), w.numpy(), np.empty((m, n), np.float32)
            packed = np.empty(lib.cblas_sgemm_pack_get_size(B_MATRIX, m, n, k) // 4 + 16, np.float32)
            lib.cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, m, n, k, 1.0, _ptr(wn), k, _ptr(packed))

            def split(axis: int, pack: bool = False) -> None:
                extent = m if axis == 0 else n
                bounds = [0, extent // 2 // 16 * 16, extent]

                def part(i: int) -> None:
                    lo, hi = bounds[i], bounds[i + 1]
                    if pack:
                        lib.cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, hi - lo, n, k, _ptr(xn, lo * k),
                                                k, _ptr(packed), k, 0.0, _ptr(y, lo * n), n)
                    elif axis == 0:  # column-major y^T = w^T x^T
                        lib.sgemm_(b"T", b"N", _int(n), _int(hi - lo), _int(k), _float(1.0), _ptr(wn),
                                   _int(k), _ptr(xn, lo * k), _int(k), _float(0.0), _ptr(y, lo * n), _int(n))
                    else:
                        lib.sgemm_(b"T", b"N", _int(hi - lo), _int(m), _int(k), _float(1.0), _ptr(wn, lo * k),
                                   _int(k), _ptr(xn), _int(k), _float(0.0), _ptr(y, lo), _int(n))

                list(pool.map(part, range(2)))

            runs: dict[str, Callable[[], object]] = {
                "torch.mm": lambda: torch.mm(x, w.t()), "rows": lambda: split(0), "columns": lambda: split(1),
                "rows, packed": lambda: split(0, True)}
            ref = (x @ w.t()).numpy()
            for key, run in runs.items():
                if key != "torch.mm":
                    run()
                    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max(), key
            samples: dict[str, list[tuple[float, float]]] = {key: [] for key in runs}
            for r in range(args.rounds):
                keys = list(runs)
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                    t0, c0 = time.perf_counter(), time.process_time()
                    runs[key]()
                    samples[key].append((time.perf_counter() - t0, time.process_time() - c0))
            wall = {key: statistics.median(s[0] for s in v) for key, v in samples.items()}
            cpu = {key: statistics.median(s[1] for s in v) for key, v in samples.items()}
            cells = [f"{key} {wall[key] * 1e3:.1f} ms ({wall['torch.mm'] / wall[key]:.2f}x)"
                     f" CPU {cpu[key] * 1e3:.1f} ms" for key in runs]
            print(f"{m} x {n} x {k}: " + "; ".join(cells), flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
