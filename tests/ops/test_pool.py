"""Max / average / adaptive-average pooling parity."""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.testing import FLOATS, cases, cpu_kernels_active, lower, lower_and_compare

# Export specialises sizes 0 and 1, so dynamic ranges start at 2.
batch = Dim("batch", min=2, max=8)
height, width = Dim("height", min=4, max=32), Dim("width", min=4, max=32)


def randn(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


def dyn(*specs):
    """dynamic_shapes for a `Lambda` (its inputs arrive as one *args tuple)."""
    return (specs,)


def distinct(*shape):
    """Integers without ties, so that max-pool indices are unambiguous (in bfloat16 only
    up to 256 elements: the index rows stay below that)."""
    def make():
        n = 1
        for s in shape:
            n *= s
        return (torch.randperm(n).reshape(shape).float() - n / 2,)
    return make


# (name, fn, input shape) -- max pooling picks values, so it is exact in every dtype.
MAX_POOLS = [
    ("max_pool1d", lambda x: F.max_pool1d(x, 2), (2, 3, 9)),
    ("max_pool1d_stride_pad_dil", lambda x: F.max_pool1d(x, 3, stride=2, padding=1, dilation=2), (2, 3, 11)),
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), (2, 3, 8, 8)),
    ("max_pool2d_k3s2p1", lambda x: F.max_pool2d(x, 3, stride=2, padding=1), (1, 4, 9, 7)),
    ("max_pool2d_ceil", lambda x: F.max_pool2d(x, 3, stride=2, ceil_mode=True), (1, 2, 8, 8)),
    ("max_pool2d_ceil_wide", lambda x: F.max_pool2d(x, 8, ceil_mode=True), (1, 2, 3, 5)),
    ("max_pool2d_ceil_pad", lambda x: F.max_pool2d(x, 2, stride=2, padding=1, ceil_mode=True), (1, 2, 7, 6)),
    ("max_pool2d_dilation", lambda x: F.max_pool2d(x, (2, 3), stride=1, dilation=(2, 1)), (1, 2, 7, 7)),
    ("max_pool2d_rect", lambda x: F.max_pool2d(x, (3, 1), stride=(1, 2), padding=(1, 0)), (2, 2, 5, 6)),
    ("max_pool2d_unbatched", lambda x: F.max_pool2d(x, 2), (3, 6, 6)),
    # Wide enough for the CPU kernel's AVX2 rows (stride 2 and 1, dilation), edges scalar; the
    # input's one zero becomes a NaN (0 / 0), which the window maxima must keep.
    ("max_pool2d_k3s2p1_wide", lambda x: F.max_pool2d(x, 3, stride=2, padding=1), (1, 2, 5, 41)),
    ("max_pool2d_s1_dil_wide", lambda x: F.max_pool2d(x, (2, 3), stride=1, padding=(0, 1), dilation=(1, 2)),
     (1, 1, 4, 30)),
    ("max_pool2d_nan_wide", lambda x: F.max_pool2d(x / x * x, 3, stride=2, padding=1), (1, 1, 6, 40)),
    ("max_pool2d_noncontig", lambda x: F.max_pool2d(x.transpose(2, 3), 2), (1, 2, 6, 8)),
    ("max_pool3d", lambda x: F.max_pool3d(x, 2), (1, 2, 4, 4, 4)),
    ("max_pool3d_pad_ceil", lambda x: F.max_pool3d(x, 3, stride=2, padding=1, ceil_mode=True), (1, 1, 5, 6, 5)),
]
# Indices are returned (so the with_indices op computes them).
INDICES = [
    ("max_pool2d_indices", lambda x: F.max_pool2d(x, 2, return_indices=True), (1, 2, 6, 6)),
    ("max_pool2d_indices_pad_dil", lambda x: F.max_pool2d(x, 3, stride=2, padding=1, dilation=2,
                                                          return_indices=True), (1, 2, 9, 8)),
    ("max_pool2d_indices_ceil", lambda x: F.max_pool2d(x, 3, stride=2, ceil_mode=True, return_indices=True),
     (1, 3, 8, 7)),
    ("max_pool3d_indices", lambda x: F.max_pool3d(x, 2, padding=1, return_indices=True), (1, 2, 4, 5, 4)),
    ("max_pool2d_indices_only", lambda x: F.max_pool2d(x, 2, return_indices=True)[1], (1, 2, 6, 6)),
]
# torch has no half-precision avg_pool3d on CPU: float32 only.
AVG_POOLS_3D = [
    ("avg_pool3d", lambda x: F.avg_pool3d(x, 2), (1, 2, 4, 4, 4)),
    ("avg_pool3d_pad_ceil_exclude", lambda x: F.avg_pool3d(x, 3, stride=2, padding=1, ceil_mode=True,
                                                           count_include_pad=False), (1, 2, 5, 6, 5)),
    ("avg_pool3d_divisor", lambda x: F.avg_pool3d(x, 2, divisor_override=5), (1, 1, 4, 4, 4)),
]
# (name, fn, input shape) -- averages.
AVG_POOLS = [
    ("avg_pool1d", lambda x: F.avg_pool1d(x, 3), (2, 3, 10)),
    ("avg_pool1d_pad_exclude", lambda x: F.avg_pool1d(x, 3, stride=2, padding=1, count_include_pad=False),
     (2, 3, 9)),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 2), (2, 3, 8, 8)),
    ("avg_pool2d_pad_include", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1), (1, 2, 7, 8)),
    ("avg_pool2d_pad_exclude", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
     (1, 2, 7, 8)),
    ("avg_pool2d_ceil", lambda x: F.avg_pool2d(x, 3, stride=2, ceil_mode=True), (1, 2, 8, 8)),
    # A window wider than the map: one output in ceil mode (EfficientNet's head).
    ("avg_pool2d_ceil_wide", lambda x: F.avg_pool2d(x, 16, ceil_mode=True), (2, 3, 3, 5)),
    # EfficientNet-B0's real head, AvgPool2d(1280, ceil_mode=True) over 7x7: the window is cut to the input.
    ("avg_pool2d_ceil_1280", lambda x: F.avg_pool2d(x, 1280, ceil_mode=True), (2, 3, 7, 7)),
    ("avg_pool2d_ceil_wide_pad", lambda x: F.avg_pool2d(x, 9, stride=4, padding=4, ceil_mode=True), (1, 2, 3, 5)),
    ("avg_pool2d_ceil_pad_include", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True), (1, 2, 8, 9)),
    ("avg_pool2d_ceil_pad_exclude", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True,
                                                           count_include_pad=False), (1, 2, 8, 9)),
    ("avg_pool2d_divisor", lambda x: F.avg_pool2d(x, 2, padding=1, divisor_override=3), (1, 2, 5, 5)),
    ("avg_pool2d_rect", lambda x: F.avg_pool2d(x, (1, 3), stride=(2, 1)), (2, 2, 6, 7)),
    ("avg_pool2d_unbatched", lambda x: F.avg_pool2d(x, 2), (3, 6, 6)),
    ("avg_pool2d_noncontig", lambda x: F.avg_pool2d(x.transpose(2, 3), 2), (1, 2, 6, 8)),
    # One window over the whole unpadded map: a mean over the flattened map (the CPU row kernel).
    ("avg_pool2d_whole_map_strided", lambda x: F.avg_pool2d(x, (5, 7), stride=3), (2, 3, 5, 7)),
    ("avg_pool2d_whole_map_noncontig", lambda x: F.avg_pool2d(x.transpose(2, 3), (7, 5)), (1, 4, 5, 7)),
    ("avg_pool2d_whole_map_divisor", lambda x: F.avg_pool2d(x, 4, divisor_override=7), (1, 2, 4, 4)),
    ("avg_pool1d_whole_map", lambda x: F.avg_pool1d(x, 9), (2, 3, 9)),
    # adaptive: output evenly divides the input
    ("adaptive_avg_pool2d_global", lambda x: F.adaptive_avg_pool2d(x, 1), (2, 4, 5, 7)),
    ("adaptive_avg_pool2d_2x3", lambda x: F.adaptive_avg_pool2d(x, (2, 3)), (1, 3, 8, 9)),
    ("adaptive_avg_pool2d_identity", lambda x: F.adaptive_avg_pool2d(x, (4, 4)), (1, 2, 4, 4)),
    ("adaptive_avg_pool1d", lambda x: F.adaptive_avg_pool1d(x, 3), (2, 3, 9)),
    ("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, (1, 2, 2)), (1, 2, 3, 4, 6)),
]

CASES = [
    *(c for name, fn, shape in MAX_POOLS for c in cases(name, fn, distinct(*shape), FLOATS, exact=True)),
    *(c for name, fn, shape in INDICES for c in cases(name, fn, distinct(*shape), FLOATS, exact=True)),
    *(c for name, fn, shape in AVG_POOLS for c in cases(name, fn, randn(shape), FLOATS)),
    *(c for name, fn, shape in AVG_POOLS_3D for c in cases(name, fn, randn(shape), (torch.float32,))),
    *cases("max_pool2d_empty_batch", lambda x: F.max_pool2d(x, 2), randn((0, 2, 4, 4)), (torch.float32,)),
    *cases("avg_pool2d_empty_batch", lambda x: F.avg_pool2d(x, 2), randn((0, 2, 4, 4)), (torch.float32,)),
    *cases("max_pool2d_dynamic", lambda x: F.max_pool2d(x, 3, stride=2, padding=1), distinct(2, 3, 8, 8),
           (torch.float32,), exact=True, dynamic_shapes=dyn({0: batch, 2: height, 3: width}),
           more_inputs=lambda: [distinct(3, 3, 11, 6)()]),
    *cases("avg_pool2d_dynamic_exclude", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1,
                                                                count_include_pad=False),
           randn((2, 3, 8, 8)), (torch.float32,), dynamic_shapes=dyn({2: height, 3: width}),
           more_inputs=lambda: [(torch.randn(2, 3, 9, 13),)]),
    *cases("adaptive_global_dynamic", lambda x: F.adaptive_avg_pool2d(x, 1), randn((2, 4, 6, 6)), (torch.float32,),
           dynamic_shapes=dyn({0: batch, 2: height, 3: width}), more_inputs=lambda: [(torch.randn(3, 4, 5, 9),)]),
]

# An output that does not divide the input stays on ExecuTorch.
CASES += cases("adaptive_uneven_refused", lambda x: F.adaptive_avg_pool2d(x, (3, 3)), randn((1, 2, 7, 8)),
               (torch.float32,), segments=0, allowed_fallback=frozenset({"_adaptive_avg_pool2d"}))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pool(case):
    lower_and_compare(case)


def test_global_average_pool_runs_the_row_mean() -> None:
    """A CNN head's global average pool (1280 channels over 7x7) is one row-kernel mean per channel
    on the CPU, not MLX's window view and sum (parity: the cases above, kernels on and off)."""
    if not cpu_kernels_active():
        pytest.skip("CPU kernels off")
    x = torch.randn(2, 1280, 7, 7)
    method = lower(torch.nn.AdaptiveAvgPool2d(1), (x,)).method()
    before = _runtime.cpu_kernel_call_counts().get("mean", 0)
    got = method.execute([x])[0]
    assert _runtime.cpu_kernel_call_counts().get("mean", 0) == before + 1
    torch.testing.assert_close(got, F.adaptive_avg_pool2d(x, 1), rtol=1e-5, atol=1e-6)
