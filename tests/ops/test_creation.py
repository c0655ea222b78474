"""Parity tests for creation ops (mlx_delegate/ops/creation.py), plus eye/linspace,
which export decomposes into arange and element-wise ops."""

import pytest
import torch
from torch.export import Dim

from mlx_delegate.testing import FLOATS, TOLERANCE, cases, lower_and_compare

aten = torch.ops.aten
INTS = (torch.int32, torch.int64)
ALL = FLOATS + INTS + (torch.bool,)
FP32 = (torch.float32,)
B = Dim("b", min=2, max=16)


def x_of(*shape):
    return lambda: (torch.randn(*shape),)


def per_dtype(name, make_fn, inputs, dtypes, **kw):
    """One config per dtype, where the function itself creates tensors of that dtype."""
    out = []
    for dt in dtypes:
        rtol, atol = TOLERANCE.get(dt, (None, None))  # the harness only knows the inputs' dtype
        out += cases(f"{name}-{str(dt).removeprefix('torch.')}", make_fn(dt), inputs, (None,), rtol=rtol,
                     atol=atol, **kw)
    return out


def dyn(name, fn, shape, more_shapes, dims=({0: B},)):
    return cases(name, fn, x_of(*shape), (None,), dynamic_shapes=(dims,),
                 more_inputs=lambda: [(torch.randn(*s),) for s in more_shapes])


FULL = [
    *per_dtype("full", lambda dt: lambda x: torch.full((2, 3), 2.5, dtype=dt), x_of(1), FLOATS),
    *per_dtype("full_int", lambda dt: lambda x: torch.full((2, 3), -7, dtype=dt), x_of(1), INTS),
    *per_dtype("full_bool", lambda dt: lambda x: torch.full((3,), True, dtype=dt), x_of(1), (torch.bool,)),
    *cases("full_big_int64", lambda x: torch.full((2,), 2**40 + 3, dtype=torch.int64), x_of(1), (None,)),
    *cases("full_inf", lambda x: torch.full((2, 2), float("-inf")) + x, x_of(2, 2), (None,)),
    *cases("full_zero_size", lambda x: torch.cat([torch.full((0, 3), 1.0), x]), x_of(2, 3), (None,)),
    *cases("full_scalar_shape", lambda x: torch.full((), 4.0) * x, x_of(3), (None,)),
    *cases("full_add", lambda x: x + torch.full((4, 6), 2.0, dtype=x.dtype), x_of(4, 6), FLOATS),
    *per_dtype("zeros", lambda dt: lambda x: torch.zeros(3, 2, dtype=dt), x_of(1), ALL),
    *per_dtype("ones", lambda dt: lambda x: torch.ones(2, 4, dtype=dt), x_of(1), ALL),
    *cases("empty_zero_size", lambda x: torch.cat([torch.empty(0, 3), x]), x_of(2, 3), (None,)),
    *cases("empty_then_fill", lambda x: torch.empty(2, 3).fill_(1.5) * x, x_of(2, 3), (None,)),
    *cases("empty_then_zero", lambda x: torch.empty(2, 3, dtype=x.dtype).zero_() + x, x_of(2, 3), FLOATS),
    *cases("scalar_tensor", lambda x: x * torch.scalar_tensor(3.0), x_of(2, 3), (None,)),
    *cases("scalar_tensor_out", lambda x: torch.scalar_tensor(-2, dtype=torch.int32), x_of(1), (None,)),
]

LIKE = [
    *cases("zeros_like", torch.zeros_like, x_of(3, 4), FLOATS),
    *cases("ones_like", torch.ones_like, x_of(3, 4), FLOATS),
    *cases("ones_like_noncontig", lambda x: torch.ones_like(x.t()), x_of(3, 4), (None,)),
    *cases("zeros_like_int", lambda x: torch.zeros_like(x, dtype=torch.int64), x_of(3, 4), (None,)),
    *cases("full_like", lambda x: torch.full_like(x, 3.25), x_of(2, 5), FLOATS),
    *cases("full_like_int_dtype", lambda x: torch.full_like(x, 9, dtype=torch.int32), x_of(2, 5), (None,)),
    *cases("full_like_bool", lambda x: torch.full_like(x, True, dtype=torch.bool), x_of(2, 5), (None,)),
    *cases("full_like_zero_size", lambda x: torch.full_like(x, 2.0), x_of(0, 5), (None,)),
    *cases("empty_like_zero", lambda x: torch.empty_like(x).zero_() + x, x_of(2, 3), (None,)),
    *cases("fill_scalar", lambda x: aten.fill.Scalar(x, 3.0), x_of(2, 3), FLOATS),
    *cases("fill_scalar_int", lambda x: aten.fill.Scalar(x.to(torch.int32), -4), x_of(2, 3), (None,)),
    *cases("fill_inplace_clone", lambda x: x.clone().fill_(0.5) + x, x_of(2, 3), (None,)),
    *cases("new_zeros", lambda x: x.new_zeros(2, 3), x_of(4), FLOATS),
    *cases("new_ones", lambda x: x.new_ones((3,)) + x, x_of(3), FLOATS),
    *cases("new_full", lambda x: x.new_full((2, 2), -1.5), x_of(4), FLOATS),
    *cases("new_full_int", lambda x: x.to(torch.int64).new_full((2, 2), 5), x_of(4), (None,)),
    *cases("new_empty_zero_size", lambda x: torch.cat([x.new_empty(0, 2), x]), x_of(3, 2), (None,)),
]

ARANGE = [
    *cases("arange_end", lambda x: torch.arange(6) + x, x_of(4, 6), (None,)),
    *cases("arange_start_step", lambda x: torch.arange(1, 13, 2), x_of(1), (None,)),
    *cases("arange_negative_step", lambda x: torch.arange(10, 0, -3), x_of(1), (None,)),
    *cases("arange_empty", lambda x: torch.arange(5, 5) * 2, x_of(1), (None,)),
    *cases("arange_float_step", lambda x: torch.arange(0, 1, 0.1), x_of(1), (None,)),
    *cases("arange_float_start", lambda x: torch.arange(2.5, 10) + x, x_of(8), (None,)),
    *per_dtype("arange_dtype", lambda dt: lambda x: torch.arange(-3, 20, 2, dtype=dt), x_of(1),
               FLOATS + INTS + (torch.uint8,)),
    *per_dtype("arange_long_half", lambda dt: lambda x: torch.arange(0, 300, 0.7, dtype=dt), x_of(1),
               FLOATS[1:]),
    *cases("arange_like_x", lambda x: torch.arange(x.shape[1], dtype=x.dtype) * x, x_of(3, 5), FLOATS),
    *cases("eye", lambda x: torch.eye(4) + x, x_of(4, 4), (None,)),
    *cases("eye_rect_int", lambda x: torch.eye(3, 5, dtype=torch.int64), x_of(1), (None,)),
    *cases("linspace", lambda x: torch.linspace(0, 1, 6) + x, x_of(2, 6), (None,)),
    *cases("linspace_neg", lambda x: torch.linspace(3, -2, 11, dtype=x.dtype), x_of(1), FLOATS),
]

DYNAMIC = [
    *dyn("dyn_arange_end", lambda x: torch.arange(x.shape[0]) * 2, (3, 2), [(7, 2), (2, 2)]),
    *dyn("dyn_arange_descending", lambda x: torch.arange(x.shape[0], 0, -1) * 2, (4, 2), [(9, 2)]),
    *dyn("dyn_arange_offset", lambda x: torch.arange(2, x.shape[0] + 2) * 2, (4, 2), [(9, 2)]),
    *dyn("dyn_arange_float", lambda x: torch.arange(x.shape[0], dtype=torch.float32) + x[:, 0], (4, 2),
         [(11, 2)]),
    *dyn("dyn_full", lambda x: torch.full((x.shape[0], 3), 1.5), (4, 2), [(6, 2)]),
    *dyn("dyn_zeros_add", lambda x: torch.zeros(x.shape[0], 2) + x, (4, 2), [(6, 2)]),
    *dyn("dyn_full_like", lambda x: torch.full_like(x, 7.0), (4, 2), [(13, 2)]),
    *dyn("dyn_ones_like_t", lambda x: torch.ones_like(x.t()) * 3, (4, 2), [(13, 2)]),
    *dyn("dyn_new_ones", lambda x: x.new_ones(x.shape[0] + 1), (4, 2), [(5, 2)]),
    *dyn("dyn_eye", lambda x: torch.eye(x.shape[0]) + x, (4, 4), [(6, 6)], dims=({0: B, 1: B},)),
]

# Values a double cannot hold exactly are refused, so the op stays on ExecuTorch (and stays right).
REFUSED = [
    *cases("full_int64_beyond_double", lambda x: torch.full((2,), 2**60 + 1), x_of(1), (None,), segments=0,
           allowed_fallback=frozenset({"full"})),
    # torch truncates fractional bounds of an integer range its own way.
    *cases("arange_int_fractional", lambda x: torch.arange(0.5, 4.2, dtype=torch.int64), x_of(1), (None,),
           segments=0, allowed_fallback=frozenset({"arange"})),
]

CASES = FULL + LIKE + ARANGE + DYNAMIC + REFUSED


@pytest.mark.parametrize("case", CASES, ids=str)
def test_creation(case):
    lower_and_compare(case)
