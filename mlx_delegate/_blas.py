"""Route MLX's CPU sgemm to the optimized BLAS inside the torch wheel (Linux).

The mlx-cpu wheel links a reference BLAS (about 20x slower than torch for
fp32 matmul and convolution). `libmlxd_blas.so` defines `cblas_sgemm` and
`cblas_dgemm` on top of torch's Fortran `sgemm_`/`dgemm_`; loaded with
RTLD_GLOBAL before libmlx.so, it serves libmlx's calls. It also offers MKL's
bf16/fp16 gemms (`mlxd_gemm_lowp`), which the runtime's CPU low-precision
matmul (cpp/kernels/gemm_lowp_cpu.cpp) uses for products of more than a few
rows. Set `MLX_DELEGATE_BLAS=reference` to keep MLX's own BLAS (and neither).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import warnings
from pathlib import Path

_state = {"mode": "off", "lib": None}


def _libmlx_loaded() -> bool:
    try:
        return "libmlx.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def install() -> str:
    """Install the fast path once; returns the mode: torch, reference, late or off."""
    if _state["lib"] is not None or _state["mode"] != "off":
        return _state["mode"]
    if not sys.platform.startswith("linux") or os.environ.get("MLX_DELEGATE_BLAS", "torch") == "reference":
        _state["mode"] = "reference"
        return _state["mode"]
    mlx_spec = importlib.util.find_spec("mlx")
    libs = Path(next(iter(mlx_spec.submodule_search_locations))).parent / "mlx_cpu.libs" if mlx_spec else None
    reference = next(iter(sorted(libs.glob("libblas*.so*"))), None) if libs and libs.exists() else None
    if _libmlx_loaded():
        if reference is not None:  # only the mlx-cpu wheel links the slow BLAS (not mlx-cuda's)
            warnings.warn("mlx_delegate: mlx was imported before mlx_delegate, so MLX keeps its slow reference "
                          "BLAS; import mlx_delegate first for fast CPU matmul", stacklevel=3)
        _state["mode"] = "late"
        return _state["mode"]
    import torch

    spec = importlib.util.find_spec("mlx_delegate._runtime")
    shim = Path(spec.origin).with_name("libmlxd_blas.so") if spec and spec.origin else None
    fast = Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"
    if shim is None or not shim.exists() or not fast.exists():
        _state["mode"] = "reference"
        return _state["mode"]
    lib = ctypes.CDLL(str(shim), mode=os.RTLD_LOCAL)
    lib.mlxd_blas_init.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.mlxd_blas_fast_calls.restype = ctypes.c_uint64
    lib.mlxd_blas_split_calls.restype = ctypes.c_uint64
    lib.mlxd_blas_serial_choices.restype = ctypes.c_uint64
    lib.mlxd_blas_set_split_policy.argtypes = [ctypes.c_int]
    lib.mlxd_blas_set_split_shape.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.mlxd_blas_split_shape.argtypes = []
    lib.mlxd_gemm_lowp_ready.argtypes = [ctypes.c_int]
    lib.mlxd_blas_set_own_sgemm.argtypes = [ctypes.c_int]
    lib.mlxd_blas_balanced_share.argtypes = [ctypes.c_int] * 5
    lib.mlxd_blas_balanced_share.restype = ctypes.c_double
    if lib.mlxd_blas_init(str(fast).encode(), str(reference).encode() if reference else None) != 1:
        _state["mode"] = "reference"
        return _state["mode"]
    ctypes.CDLL(str(shim), mode=os.RTLD_GLOBAL)  # now visible to libmlx's symbol lookup
    _state.update(mode="torch", lib=lib)
    return _state["mode"]


def mode() -> str:
    return _state["mode"]


def fast_calls() -> int:
    """Number of gemm calls served by the fast BLAS so far."""
    return int(_state["lib"].mlxd_blas_fast_calls()) if _state["lib"] is not None else 0


def split_calls() -> int:
    """Number of fp32 gemms cut into single-threaded blocks on the runtime's helper pool so far."""
    return int(_state["lib"].mlxd_blas_split_calls()) if _state["lib"] is not None else 0


def lowp_gemm_ready() -> dict[str, bool]:
    """Whether torch's MKL serves bf16 / fp16 gemms through the shim (for tests and benchmarks)."""
    lib = _state["lib"]
    return {name: lib is not None and bool(lib.mlxd_gemm_lowp_ready(code))
            for code, name in enumerate(("bfloat16", "float16"))}


def serial_choices() -> int:
    """Number of large fp32 gemms that the measured choice ran as one single-threaded call."""
    return int(_state["lib"].mlxd_blas_serial_choices()) if _state["lib"] is not None else 0


_SPLIT_POLICIES = ("never", "measured", "always", "balanced")


def split_policy() -> str:
    """The current split policy (see `set_split_policy`)."""
    previous = set_split_policy("always")
    set_split_policy(previous)
    return previous


def set_split_policy(policy: str) -> str:
    """How large fp32 products use the runtime's helper pool while splitting is on: "always" (the
    default; even blocks), "balanced" (always split, the calling thread's block sized per product
    shape by the helpers' measured speed; `MLX_DELEGATE_BLAS_SPLIT=balanced` at start-up),
    "measured" (each product shape runs split or as one call, whichever its recent calls timed
    faster; `MLX_DELEGATE_BLAS_SPLIT=measured`) or "never". Returns the previous policy."""
    if policy not in _SPLIT_POLICIES:
        raise ValueError(f"split policy must be one of {_SPLIT_POLICIES}, got {policy!r}")
    if _state["lib"] is None:
        return "always"
    return _SPLIT_POLICIES[_state["lib"].mlxd_blas_set_split_policy(_SPLIT_POLICIES.index(policy))]


_SPLIT_AXES = ("longer", "rows", "columns")


def set_split_shape(parts_per_thread: int, axis: str = "longer") -> tuple[int, str]:
    """How a split fp32 product is cut: `parts_per_thread` blocks (1-4) per pool thread, along the
    output's "rows", "columns" or its "longer" axis. Returns the previous setting."""
    if axis not in _SPLIT_AXES:
        raise ValueError(f"split axis must be one of {_SPLIT_AXES}, got {axis!r}")
    if not 1 <= parts_per_thread <= 4:
        raise ValueError(f"parts per thread must be 1-4, got {parts_per_thread}")
    if _state["lib"] is None:
        return (parts_per_thread, axis)
    previous = _state["lib"].mlxd_blas_set_split_shape(parts_per_thread, _SPLIT_AXES.index(axis))
    return (previous // 4, _SPLIT_AXES[previous % 4])


def balanced_share(m: int, n: int, k: int, trans_a: bool = False, trans_b: bool = False) -> float:
    """The calling thread's share (0-1) of a row-major m x k . k x n product under the "balanced"
    policy, as its recent calls measured it; 0.0 when that shape has none yet."""
    if _state["lib"] is None:
        return 0.0
    return float(_state["lib"].mlxd_blas_balanced_share(int(trans_a), int(trans_b), m, n, k))


def split_shape() -> tuple[int, str]:
    """The current split shape (see `set_split_shape`)."""
    if _state["lib"] is None:
        return (1, "longer")
    code = _state["lib"].mlxd_blas_split_shape()
    return (code // 4, _SPLIT_AXES[code % 4])


# By the front's code (mlxd_blas_set_own_sgemm): MKL, then the own tiles (cpp/sgemm_x86.h).
_SGEMM_KINDS = ("mkl", "avx2", "avx512")


def sgemm_kind() -> str:
    """Which single-threaded fp32 gemm serves the pool's product blocks: "mkl", "avx2" or "avx512"
    (see `set_sgemm_kind`)."""
    previous = set_sgemm_kind("mkl")
    set_sgemm_kind(previous)
    return previous


def set_sgemm_kind(kind: str) -> str:
    """Which single-threaded fp32 gemm serves the blocks a large product is cut into: "mkl" (torch's
    MKL), "avx2" / "avx512" (the front's own register tiles), or "own" (the widest own tile this
    processor runs). The default is the widest own tile, except on Intel processors with AVX-512, which
    keep MKL's AVX-512 kernels. `MLX_DELEGATE_SGEMM` (mkl / own / own-avx2) chooses at start-up. A tile
    the processor cannot run falls back to the widest it can (MKL without AVX2 + FMA). Returns the
    previous kind."""
    choices = (*_SGEMM_KINDS, "own")
    if kind not in choices:
        raise ValueError(f"sgemm kind must be one of {choices}, got {kind!r}")
    if _state["lib"] is None:
        return "mkl"
    code = len(_SGEMM_KINDS) - 1 if kind == "own" else _SGEMM_KINDS.index(kind)
    return _SGEMM_KINDS[_state["lib"].mlxd_blas_set_own_sgemm(code)]


def _ld(x) -> int:
    """The row stride (floats) of a float32 matrix with unit column stride, for the front's calls."""
    if x.dtype.name != "float32" or x.ndim != 2 or (x.size and (x.strides[1] != 4 or x.strides[0] % 4)):
        raise ValueError("the front's sgemms take float32 matrices with unit column stride")
    return max(1, x.strides[0] // 4 if x.size else x.shape[1])


def _front():
    if _state["lib"] is None:
        raise RuntimeError("the BLAS front is not installed")
    return _state["lib"]


def serial_sgemm(a, b, trans_a: bool = False, trans_b: bool = False, alpha: float = 1.0, beta: float = 0.0, c=None):
    """alpha op(a) @ op(b) + beta c on the calling thread through the front's single-threaded sgemm
    (what the pool's blocks call), for tests: a, b (and c) C-contiguous float32 numpy matrices, or
    row-strided views of them; returns the result (c, written in place, when given)."""
    import numpy as np

    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    if (b.shape[1] if trans_b else b.shape[0]) != k:
        raise ValueError(f"inner dimensions differ: {a.shape} and {b.shape}")
    out = np.zeros((m, n), np.float32) if c is None else c
    if out.shape != (m, n):
        raise ValueError(f"c has shape {out.shape}, expected {(m, n)}")
    f = _front().mlxd_sgemm_serial
    f.argtypes = [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    f(int(trans_a), int(trans_b), m, n, k, alpha, a.ctypes.data, _ld(a), b.ctypes.data, _ld(b), beta,
      out.ctypes.data, _ld(out))
    return out


def pack_a(a, hints: tuple[int, int], across: bool = False):
    """a [m, k] (float32, unit column stride) laid out once for the current own tile, as the
    convolutions' weights are (products of about hints = (rows, columns), written across by
    `packed_sgemm_ct` when `across`): a numpy float32 buffer for `packed_sgemm` / `packed_sgemm_ct`, or
    None where MKL serves the products (nothing is packed). For tests."""
    import numpy as np

    lib = _front()
    lib.mlxd_sgemm_pack_a_floats.restype = ctypes.c_int64
    lib.mlxd_sgemm_pack_a_floats.argtypes = [ctypes.c_int, ctypes.c_int]
    m, k = a.shape
    size = lib.mlxd_sgemm_pack_a_floats(m, k)
    if size == 0:
        return None
    pack = np.empty(size, np.float32)
    lib.mlxd_sgemm_pack_a.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.mlxd_sgemm_pack_a(m, k, hints[0], hints[1], int(across), a.ctypes.data, _ld(a), pack.ctypes.data)
    return pack


def pack_align(pack) -> int:
    """The multiple `packed_sgemm`'s first row must be for this pack."""
    lib = _front()
    lib.mlxd_sgemm_pack_align.argtypes = [ctypes.c_void_p]
    return lib.mlxd_sgemm_pack_align(pack.ctypes.data)


def packed_sgemm(pack, r0: int, b, trans_b: bool = False, alpha: float = 1.0, beta: float = 0.0, c=None,
                 rows: int | None = None) -> bool:
    """c = alpha a[r0 : r0 + rows] @ op(b) + beta c with a from `pack_a`, on the calling thread, for
    tests; c is written in place. False (c untouched) where the pack does not fit: made for another
    tile than the current one, another k (b's), rows outside it, or r0 not a multiple of `pack_align`."""
    lib = _front()
    n, k = (b.shape[0], b.shape[1]) if trans_b else (b.shape[1], b.shape[0])
    m = c.shape[0] if rows is None else rows
    f = lib.mlxd_sgemm_serial_packed
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                           ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return f(pack.ctypes.data, r0, m, k, int(trans_b), n, alpha, b.ctypes.data, _ld(b), beta, c.ctypes.data,
             _ld(c)) == 1


def packed_sgemm_ct(pack, r0: int, rows: int, b, ct, alpha: float = 1.0, beta: float = 0.0) -> bool:
    """`packed_sgemm`'s product written across: ct [n, rows] = alpha (a[r0 : r0 + rows] @ b)^T + beta ct,
    in place, for tests (b [k, n] row-major); False (ct untouched) where the pack does not fit."""
    lib = _front()
    k, n = b.shape
    f = lib.mlxd_sgemm_serial_packed_ct
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                           ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return f(pack.ctypes.data, r0, rows, k, 0, n, alpha, b.ctypes.data, _ld(b), beta, ct.ctypes.data,
             _ld(ct)) == 1
