"""The CPU convolution (cpp/kernels/conv_cpu.cpp, counters "conv_gemm" and "conv_depthwise"):
1-D and 2-D convolutions on the channels-first layout, through im2col + sgemm, the direct 1x1
GEMM and the depthwise loops (the padded-grid loop for maps narrower than a vector row, and the
row-by-row loop with `set_conv_tiles(False)`), match eager torch and MLX's own convolution
(MLX_DELEGATE_CPU_KERNELS=0) in float32, bfloat16 and float16, node by node and compiled, at odd
shapes, strides, padding, dilation, groups and channel multipliers. One program per dtype holds
every case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import _runtime
from mlx_delegate.testing import (
    CALLS_TO_REPLAY, FP32_REFERENCE_TOLERANCE, assert_close, cpu_kernels_active, fp32_tolerance, lower,
    runtime_switches,
)

C = 6
# (weight shape [O, C/groups, *k], keyword arguments of F.conv2d): the paths and the edge handling.
CONV2D = [
    ((5, C, 3, 3), dict(padding=1)),  # im2col, bias
    ((4, C, 3, 3), dict(stride=2, dilation=2)),  # strided, dilated, unpadded
    ((7, C, 1, 1), dict()),  # 1x1: a plain GEMM on the input planes
    ((3, C, 1, 1), dict(stride=2)),  # 1x1 strided: gathered first
    ((9, 2, 2, 3), dict(groups=3, padding=(1, 0), stride=(1, 2))),  # grouped, odd kernel
    ((C, 1, 3, 3), dict(groups=C, stride=2, padding=1)),  # depthwise
    ((2 * C, 1, 5, 5), dict(groups=C, padding=2, dilation=(1, 2))),  # depthwise, multiplier 2
    ((C, 1, 3, 3), dict(groups=C, padding=3)),  # padding wider than the kernel's reach
    ((4, C, 1, 7), dict(padding=(0, 3))),  # a 1x7 row kernel
]
CONV1D = ((4, 3, 5), dict(stride=3, padding=2, dilation=2, groups=2))
K_MAX = C * 3 * 3  # the longest dot product


class Convs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=g) / (s[1] * s[2] * s[3]) ** 0.5) for s, _ in CONV2D])
        self.biases = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s[0], generator=g)) for s, _ in CONV2D])
        self.w1d = torch.nn.Parameter(torch.randn(CONV1D[0], generator=g) / 4)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [F.conv2d(x, w, b if i % 2 == 0 else None, **kw)
               for i, ((_, kw), w, b) in enumerate(zip(CONV2D, self.weights, self.biases))]
        out.append(F.conv1d(x.flatten(2), self.w1d, **CONV1D[1]))  # [2, 6, 99]
        return out


def counts() -> dict[str, int]:
    c = _runtime.cpu_kernel_call_counts()
    return {k: c.get(k, 0) for k in ("conv_gemm", "conv_depthwise", "conv_depthwise_padded")}


@pytest.fixture(scope="module")
def model() -> Convs:
    return Convs().eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_conv_cpu_matches_eager_and_kernels_off(model: Convs, dtype: torch.dtype) -> None:
    x = torch.randn(2, C, 11, 9, generator=torch.Generator().manual_seed(1))
    module = Convs().eval().to(dtype)
    module.load_state_dict(model.state_dict())
    module.to(dtype)
    lowered = lower(module, (x.to(dtype),))
    assert lowered.summary[1] == [], lowered.summary
    with torch.no_grad():  # the true result: float32 on the same (rounded) inputs and weights
        expected = Convs().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = expected(x.to(dtype).float())
    rtol, atol = fp32_tolerance(K_MAX) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]

    before = counts()
    on = lowered.fresh_method()
    for _ in range(CALLS_TO_REPLAY):  # node by node, traced, replayed
        got = on.execute([x.to(dtype)])
        assert [g.dtype for g in got] == [dtype] * len(reference)
        assert_close([g.float() for g in got], reference, rtol, atol)
    after = counts()
    if cpu_kernels_active():  # 6 im2col/GEMM convolutions (with the 1-D one) and 3 depthwise per call
        assert after["conv_gemm"] - before["conv_gemm"] >= 7
        assert after["conv_depthwise"] - before["conv_depthwise"] >= 3
        if _runtime.cpu_vector_kernels():  # these maps are narrower than a vector row: the padded-grid loop
            assert after["conv_depthwise_padded"] - before["conv_depthwise_padded"] >= 3

    was = _runtime.conv_tiles()
    _runtime.set_conv_tiles(False)  # the row-by-row depthwise loop and the whole-image GEMM paths
    try:
        rows = lowered.fresh_method().execute([x.to(dtype)])
        assert counts()["conv_depthwise_padded"] == after["conv_depthwise_padded"]
    finally:
        _runtime.set_conv_tiles(was)
    assert_close([g.float() for g in got], [r.float() for r in rows], rtol, atol)
    after = counts()

    with runtime_switches(cpu_kernels=False):
        off = lowered.fresh_method().execute([x.to(dtype)])
    assert counts() == after  # MLX's own convolution ran
    assert_close([g.float() for g in got], [o.float() for o in off], rtol, atol)
