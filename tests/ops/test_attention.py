import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import mlx_delegate
from mlx_delegate.testing import FLOATS, cases, lower_and_compare

F32 = (torch.float32,)


def qkv(b=1, hq=4, hk=4, lq=5, lk=5, e=8, ev=None):
    return lambda: (torch.randn(b, hq, lq, e), torch.randn(b, hk, lk, e), torch.randn(b, hk, lk, ev or e))


def with_mask(make, mask):
    return lambda: (*make(), mask())


def bool_mask(lq, lk, empty_row=None):
    def make():
        m = torch.rand(lq, lk) > 0.3
        m[:, 0] = True
        if empty_row is not None:
            m[empty_row] = False
        return m
    return make


def float_mask(shape, empty_row=None):
    def make():
        m = torch.randn(*shape)
        if empty_row is not None:
            m[..., empty_row, :] = float("-inf")
        return m
    return make


def sdpa(**kw):
    return lambda q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


def dynamic_q(dtype):
    """Same program run with several query lengths (to_edge narrows the range to >= 2)."""
    def more():
        torch.manual_seed(1)
        return [tuple(x.to(dtype) for x in qkv(hq=4, hk=2, lq=lq, lk=9)()) for lq in (3, 9, 2)]
    return more


CASES = [
    *cases("sdpa", sdpa(), qkv(b=2), FLOATS),
    *cases("sdpa_scale", sdpa(scale=0.5), qkv(), F32),
    *cases("sdpa_gqa", sdpa(enable_gqa=True), qkv(hq=8, hk=2, lq=3, lk=7), FLOATS),
    *cases("sdpa_causal", sdpa(is_causal=True), qkv(lq=6, lk=6), F32),
    # torch aligns is_causal top-left when the lengths differ, MLX's "causal" bottom-right.
    *cases("sdpa_causal_short_q", sdpa(is_causal=True), qkv(lq=3, lk=7), FLOATS),
    *cases("sdpa_causal_long_q", sdpa(is_causal=True), qkv(lq=7, lk=3), F32),
    *cases("sdpa_causal_gqa", sdpa(is_causal=True, enable_gqa=True), qkv(hq=6, hk=2, lq=4, lk=4), F32),
    *cases("sdpa_bool_mask", sdpa(), with_mask(qkv(lq=4, lk=6), bool_mask(4, 6)), FLOATS),
    *cases("sdpa_float_mask", sdpa(), with_mask(qkv(b=2, lq=4, lk=6), float_mask((2, 1, 4, 6))), F32),
    *cases("sdpa_gqa_mask_per_head", sdpa(enable_gqa=True),
           with_mask(qkv(hq=4, hk=2, lq=3, lk=5), float_mask((1, 4, 3, 5))), F32),
    *cases("sdpa_bool_mask_empty_row", sdpa(), with_mask(qkv(lq=4, lk=6), bool_mask(4, 6, empty_row=2)),
           F32),
    *cases("sdpa_float_mask_empty_row", sdpa(), with_mask(qkv(lq=4, lk=6), float_mask((4, 6), empty_row=1)),
           FLOATS),
    *cases("sdpa_value_dim", sdpa(), qkv(e=8, ev=12), F32),
]

DYNAMIC = [
    case
    for dtype in FLOATS
    for case in cases(
        "sdpa_dynamic_q", sdpa(enable_gqa=True), qkv(hq=4, hk=2, lq=2, lk=9), (dtype,),
        dynamic_shapes=(({2: Dim("q_len", min=1, max=64)}, None, None),), more_inputs=dynamic_q(dtype))
]


@pytest.mark.parametrize("case", CASES + DYNAMIC, ids=str)
def test_sdpa(case):
    lower_and_compare(case)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "mlx"])
def test_sdpa_cpu_path(kernels):
    """float32 attention on the CPU is composed around the two-core softmax kernel (with the
    kernels on); both paths match eager torch (GQA, causal with L < S, a fully masked row)."""
    runtime = mlx_delegate._runtime
    was = runtime.cpu_kernels_enabled()
    runtime.set_cpu_kernels(kernels)
    try:
        before = runtime.cpu_kernel_call_counts().get("softmax", 0)
        for case in cases("sdpa_gqa", sdpa(enable_gqa=True), qkv(hq=8, hk=2, lq=3, lk=7), F32) + \
                cases("sdpa_causal_short_q", sdpa(is_causal=True), qkv(lq=3, lk=7), F32) + \
                cases("sdpa_bool_mask_empty_row", sdpa(), with_mask(qkv(lq=4, lk=6), bool_mask(4, 6, empty_row=2)),
                      F32):
            lower_and_compare(case)
        ran = runtime.cpu_kernel_call_counts().get("softmax", 0) - before
    finally:
        runtime.set_cpu_kernels(was)
    assert (ran >= 3) if kernels else (ran == 0)
