"""The CPU convolution's tiled path (cpp/kernels/conv_cpu.cpp `run_tiled`, counter "conv_tiled"):
large im2col products and 1x1 products cut into tiles of output rows, each tile's im2col, bias /
residual, sgemm and clamp on one thread; and its blocked path for one-image products below a tile
(counter "conv_row_blocks": blocks of output channels, each block's bias / residual, sgemm and
clamp on one thread). Both run on the weights laid out once for the own gemm's tile (counter
"conv_packed_weights"), and on the plain weights when another tile serves the products since. They match eager torch, the whole-image path
(`_runtime.set_conv_tiles(False)`) and MLX's own convolution (kernels off) in float32, bfloat16 and
float16, at odd sizes (bands of unequal heights), stride 2, dilation, groups, asymmetric padding, a
fused residual + ReLU, a fused ReLU6 on a 1x1 convolution, batch 2 and batch 1 (the stride-2
convolution: at batch 2 its images would share one whole-image product). One program per dtype."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlx_delegate import _blas, _runtime
from mlx_delegate.testing import (
    CALLS_TO_REPLAY, FP32_REFERENCE_TOLERANCE, assert_close, cpu_kernels_active, fp32_tolerance, lower,
    runtime_switch, runtime_switches,
)

C = 16
K_MAX = 8 * 7 * 7  # the longest dot product (the 7x7 convolution)


class Tiled(nn.Module):
    """Each convolution's product is larger than one tile (> 2^17 floats of im2col columns, or of
    output columns for the 1x1), with weights small enough for the tiled path."""

    def __init__(self) -> None:
        super().__init__()
        self.res = nn.Conv2d(C, C, 3, padding=1)                          # relu(res(x) + x): residual + clamp
        self.strided = nn.Conv2d(8, 8, 7, stride=2, padding=3, bias=False)  # on z: 4 bands of 8 or 9 rows
        self.dilated = nn.Conv2d(C, 6, 3, padding=2, dilation=2)
        self.grouped = nn.Conv2d(C, 8, 5, padding=(2, 1), groups=2)         # narrower output than input
        self.wide = nn.Conv2d(C, 128, 1)                                    # 1x1 on the input planes, ReLU6
        # Below one tile, at batch 1: blocks of output channels (40: a partial block of 16).
        self.small = nn.Conv2d(8, 40, 3, stride=2, padding=1)              # im2col, ReLU
        self.small_res = nn.Conv2d(8, 8, 1)                                 # 1x1 + residual

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> list[torch.Tensor]:
        return [torch.relu(self.res(x) + x), self.strided(z), self.dilated(x), self.grouped(x),
                F.relu6(self.wide(x)), torch.relu(self.small(z)), self.small_res(z) + z]




def tiled_calls() -> tuple[int, int, int]:
    """Calls of the tiled path, of the blocked path, and of either with the weights packed once."""
    counts = _runtime.cpu_kernel_call_counts()
    return counts.get("conv_tiled", 0), counts.get("conv_row_blocks", 0), counts.get("conv_packed_weights", 0)


@pytest.fixture(scope="module")
def model() -> Tiled:
    torch.manual_seed(0)
    return Tiled().eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tiled_conv_matches_eager_whole_image_and_kernels_off(model: Tiled, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, z = torch.randn(2, C, 33, 35, generator=gen), torch.randn(1, 8, 67, 65, generator=gen)
    inputs = [x.to(dtype), z.to(dtype)]
    module = Tiled().eval()
    module.load_state_dict(model.state_dict())
    module = module.to(dtype)
    lowered = lower(module, tuple(inputs))
    assert lowered.summary[1] == [], lowered.summary
    with torch.no_grad():  # the true result: float32 on the same (rounded) inputs and weights
        expected = Tiled().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = expected(*(i.float() for i in inputs))
    rtol, atol = fp32_tolerance(K_MAX) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]

    with runtime_switch("conv_tiles", True):
        before = tiled_calls()
        method = lowered.fresh_method()
        for _ in range(CALLS_TO_REPLAY):  # node by node, traced, replayed
            got = method.execute(inputs)
            assert [g.dtype for g in got] == [dtype] * len(reference)
            assert_close([g.float() for g in got], reference, rtol, atol)
        if cpu_kernels_active():  # five convolutions took the tiled path and two the blocked one, every call
            after = tiled_calls()
            # All seven on their weights packed once for the own gemm's tile (none where MKL serves them).
            packed = 7 * CALLS_TO_REPLAY if _blas.sgemm_kind() != "mkl" else 0
            assert tuple(a - b for a, b in zip(after, before)) == (5 * CALLS_TO_REPLAY, 2 * CALLS_TO_REPLAY, packed)

    if _blas.sgemm_kind() != "mkl":  # packed for this tile; another serves products now: the plain weights
        other = "avx2" if _blas.sgemm_kind() == "avx512" else "mkl"
        previous = _blas.set_sgemm_kind(other)
        try:
            count = tiled_calls()[2]
            stale = method.execute(inputs)
            assert tiled_calls()[2] == count
        finally:
            _blas.set_sgemm_kind(previous)
        assert_close([g.float() for g in stale], reference, rtol, atol)

    with runtime_switch("conv_tiles", False):  # whole-image im2col / GEMM (no tiles, no blocks), same program
        count = tiled_calls()
        whole = method.execute(inputs)
        assert tiled_calls() == count
    assert_close([g.float() for g in got], [w.float() for w in whole], rtol, atol)

    with runtime_switches(cpu_kernels=False):  # MLX's own convolution
        off = lowered.fresh_method().execute(inputs)
    assert_close([g.float() for g in got], [o.float() for o in off], rtol, atol)
