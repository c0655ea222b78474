"""The CPU fp32 linear kernel (cpp/kernels/linear_cpu.cpp, on by default, switched on here), each output
block's bias (and a fused GELU / SiLU) applied in the task that computes it: linears large enough to be cut into column blocks,
row blocks (long ones into more blocks than pool threads) or run whole, with and without a bias, a strided bias, a non-contiguous input and 3-D
inputs, match eager torch node by node, compiled and with the CPU kernels off (`lower_and_compare`);
bf16 / fp16 take the low-precision matmul and must still match. The call counter proves the kernel
ran on fp32 and not on the half types."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import _blas, _runtime
from mlx_delegate.testing import FLOATS, cases, cpu_kernels_active, fp32_tolerance, lower, lower_and_compare

HALF = {torch.float16: (3e-2, 3e-2), torch.bfloat16: (5e-2, 5e-2)}


def randn(*shapes):
    return lambda: tuple(torch.randn(*s) / s[-1] ** 0.25 for s in shapes)


def tol(k: int) -> dict:
    return {"tolerance": {torch.float32: fp32_tolerance(k), **HALF}}


# 74 x 200 x 160 (2.4M multiply-adds): split into column blocks whose bounds fall off 16s;
# 520 x 40 x 96: split into row blocks; 9 x 24 x 40: one call (below the split size);
# a transposed input (packed in the kernel) and a strided bias (made contiguous in the graph).
CASES = [
    *cases("columns_bias", lambda x, w, b: F.linear(x, w, b), randn((2, 37, 160), (200, 160), (200,)),
           FLOATS, **tol(160)),
    *cases("columns_no_bias", lambda x, w: F.linear(x, w), randn((2, 37, 160), (200, 160)), FLOATS, **tol(160)),
    *cases("rows_bias", lambda x, w, b: F.linear(x, w, b), randn((520, 96), (40, 96), (40,)), FLOATS, **tol(96)),
    *cases("small_bias", lambda x, w, b: F.linear(x, w, b), randn((9, 40), (24, 40), (24,)), FLOATS, **tol(40)),
    # a fused activation (fuse_linear_activation) applied to each block after its bias: column blocks, row blocks
    *cases("columns_bias_gelu", lambda x, w, b: F.gelu(F.linear(x, w, b)), randn((2, 37, 160), (200, 160), (200,)),
           FLOATS, **tol(160)),
    *cases("rows_silu", lambda x, w: F.silu(F.linear(x, w)), randn((520, 96), (40, 96)), FLOATS, **tol(96)),
    # long products (over 256M multiply-adds) cut into more parts than pool threads, by size: 1001 x 1030
    # x 520 in column blocks, 1600 x 400 x 512 in row blocks with a GELU applied in each block
    *cases("long_columns_bias", lambda x, w, b: F.linear(x, w, b), randn((1001, 520), (1030, 520), (1030,)),
           FLOATS, **tol(520)),
    *cases("long_rows_gelu", lambda x, w, b: F.gelu(F.linear(x, w, b)), randn((1600, 512), (400, 512), (400,)),
           FLOATS, **tol(512)),
    *cases("noncontig_input_strided_bias", lambda x, w, b: F.linear(x.transpose(0, 1), w, b[::2]),
           randn((144, 140), (130, 144), (260,)), FLOATS, **tol(144)),
]


@pytest.fixture(autouse=True)
def linear_kernel_on():
    previous = _runtime.set_linear_kernel(True)
    yield
    _runtime.set_linear_kernel(previous)


def kernel_calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("linear_f32", 0)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_linear_kernel(case) -> None:
    before = kernel_calls()
    lower_and_compare(case)
    ran = kernel_calls() - before
    # Node by node once, compiled (traced once: the replays run the compiled graph's kernel), never
    # with the kernels off; half types never (they take the low-precision matmul).
    if case.dtype == torch.float32 and cpu_kernels_active() and _blas.mode() == "torch":
        assert ran >= 2, f"the linear kernel ran {ran} times"
    elif case.dtype != torch.float32:
        assert ran == 0


@pytest.mark.skipif(_blas.mode() != "torch", reason="needs the BLAS front")
@pytest.mark.parametrize("parts,axis", [(1, "longer"), (4, "rows"), (3, "columns")])
def test_split_shapes_agree(parts: int, axis: str) -> None:
    """Every split shape gives the same product: the blocks tile the output exactly once."""
    torch.manual_seed(0)
    x, w, b = torch.randn(70, 300), torch.randn(260, 300), torch.randn(260)
    method = lower(_Linear(w, b).eval(), (x,)).method()
    previous = _blas.set_split_shape(parts, axis)
    try:
        got = method.execute([x])[0]
    finally:
        _blas.set_split_shape(*previous)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=fp32_tolerance(300)[1] * 10)


class _Linear(torch.nn.Module):
    def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.w, self.b = torch.nn.Parameter(w), torch.nn.Parameter(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, self.b)


def test_split_shape_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="split axis"):
        _blas.set_split_shape(2, "diagonal")
    with pytest.raises(ValueError, match="parts per thread"):
        _blas.set_split_shape(0)


@pytest.mark.skipif(_blas.mode() != "torch", reason="needs the BLAS front")
@pytest.mark.parametrize("setting", ["measured", "balanced", "split off"])
def test_kernel_steps_aside_unless_products_are_cut_evenly(setting: str) -> None:
    """Under the front's other split policies, or with splitting off (MKL's own team), MLX's matmul
    takes the linears, so those switches still decide how products run; the result is the same."""
    torch.manual_seed(0)
    x, w, b = torch.randn(70, 300), torch.randn(260, 300), torch.randn(260)
    lowered = lower(_Linear(w, b).eval(), (x,))
    previous = _blas.set_split_policy(setting) if setting != "split off" else _runtime.set_blas_split(False)
    before = kernel_calls()
    try:
        got = lowered.fresh_method().execute([x])[0]
    finally:
        if setting == "split off":
            _runtime.set_blas_split(True)
        else:
            _blas.set_split_policy(previous)
    assert kernel_calls() == before
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=fp32_tolerance(300)[1] * 10)
