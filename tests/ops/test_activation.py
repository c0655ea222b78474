"""Parity tests for activations (fixed ones and the parameterised ones composed
from element-wise nodes)."""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate.testing import FLOATS, cases, lower_and_compare


def randn(*shape, scale=3.0):
    """Wide inputs, so both sides of every kink are hit."""
    return lambda: (torch.randn(*shape) * scale,)


def with_specials(*shape):
    """Random values plus +-inf and large magnitudes (overflow paths in fp16)."""
    return lambda: (torch.cat([torch.randn(*shape) * 3,
                               torch.tensor([float("inf"), -float("inf"), 15.0, -15.0, 30.0, 0.0])]),)


def transposed(fn):
    return lambda x: fn(x.transpose(0, 1))


# (name, fn, inputs); every row runs in fp32, fp16 and bf16.
ROWS = [
    ("relu", F.relu, randn(3, 4)), ("relu6", F.relu6, randn(3, 4)), ("silu", F.silu, randn(3, 4)),
    ("gelu", F.gelu, randn(3, 4)), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), randn(3, 4)),
    ("sigmoid", torch.sigmoid, randn(3, 4)), ("tanh", torch.tanh, randn(3, 4)),
    ("hardtanh", F.hardtanh, randn(3, 4)), ("hardtanh_range", lambda x: F.hardtanh(x, -0.5, 2.0), randn(3, 4)),
    ("leaky_relu", F.leaky_relu, randn(3, 4)), ("leaky_relu_0.2", lambda x: F.leaky_relu(x, 0.2), randn(3, 4)),
    ("leaky_relu_steep", lambda x: F.leaky_relu(x, 1.5), randn(3, 4)),
    ("elu", F.elu, randn(3, 4)), ("elu_alpha", lambda x: F.elu(x, alpha=0.5), randn(3, 4)),
    ("selu", F.selu, randn(3, 4)), ("celu", lambda x: F.celu(x, alpha=1.5), randn(3, 4)),
    ("softplus", F.softplus, with_specials(8)), ("softplus_beta", lambda x: F.softplus(x, beta=2.0), randn(3, 4)),
    ("softplus_threshold", lambda x: F.softplus(x, beta=0.5, threshold=1.0), randn(3, 4)),
    ("softplus_high_threshold", lambda x: F.softplus(x, beta=1.0, threshold=40.0), with_specials(8)),
    ("hardswish", F.hardswish, randn(3, 4)), ("hardsigmoid", F.hardsigmoid, randn(3, 4)),
    # the CPU kernel's vector body, its tail and the specials (NaN, inf), and a non-contiguous input
    ("hardswish_specials", F.hardswish, lambda: (torch.cat([torch.randn(37) * 4, torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -3.0, 3.0, 0.0])]),)),
    ("hardsigmoid_specials", F.hardsigmoid, with_specials(27)),
    ("hardswish_nc", transposed(F.hardswish), randn(5, 7)),
    ("mish", F.mish, with_specials(8)), ("glu", F.glu, randn(3, 8)), ("glu_dim0", lambda x: F.glu(x, 0), randn(4, 3)),
    ("glu_neg_dim", lambda x: F.glu(x, -2), randn(2, 6, 3)),
    ("logit", torch.logit, lambda: (torch.rand(3, 4) * 0.9 + 0.05,)),
    ("logit_eps", lambda x: torch.logit(x, eps=0.1), lambda: (torch.rand(3, 4),)),
    ("softsign", F.softsign, randn(3, 4)), ("tanhshrink", F.tanhshrink, randn(3, 4)),
    ("hardshrink", F.hardshrink, randn(3, 4)), ("threshold", lambda x: F.threshold(x, 0.1, -2.0), randn(3, 4)),
    ("silu_nc", transposed(F.silu), randn(4, 3)), ("gelu_nc", transposed(F.gelu), randn(4, 3)),
    ("elu_nc", transposed(F.elu), randn(4, 3)), ("glu_nc", transposed(F.glu), randn(6, 3)),
    ("leaky_relu_zero_size", F.leaky_relu, randn(0, 4)), ("softplus_zero_size", F.softplus, randn(2, 0)),
]

# Activations are defined on floats only, except relu/hardtanh (compared exactly on ints).
INT_ROWS = [
    ("relu-int32", F.relu, torch.int32), ("relu-int64", F.relu, torch.int64),
    ("hardtanh-int32", lambda x: F.hardtanh(x, -2, 3), torch.int32),
]

seq = Dim("seq", min=2, max=64)
DYNAMIC = [
    cases(f"dyn_{name}", fn, randn(3, 4), (torch.float32,), dynamic_shapes=(({0: seq},),),
          more_inputs=lambda: [(torch.randn(9, 4) * 3,), (torch.randn(2, 4) * 3,)])
    for name, fn in [("gelu", F.gelu), ("elu", F.elu), ("softplus", lambda x: F.softplus(x, 2.0, 1.0)),
                     ("glu", F.glu), ("leaky_relu", lambda x: F.leaky_relu(x, 0.3))]
]
# A dynamic size along glu's dim: the handler declines, and the decomposition (slices) is lowered.
GLU_DYNAMIC_DIM = cases("glu_dynamic_dim", lambda x: F.glu(x, 0), randn(4, 3), (torch.float32,),
                        dynamic_shapes=(({0: 2 * Dim("half", min=1, max=32)},),),
                        more_inputs=lambda: [(torch.randn(10, 3),), (torch.randn(6, 3),)])

CASES = [
    *[c for name, fn, inp in ROWS for c in cases(name, fn, inp, FLOATS)],
    *[c for name, fn, dt in INT_ROWS for c in cases(name, fn, lambda dt=dt: (torch.randint(-5, 6, (3, 4), dtype=dt),),
                                                    (None,))],
    *[c for group in DYNAMIC for c in group], *GLU_DYNAMIC_DIM,
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_activation(case):
    lower_and_compare(case)
