from typing import Callable

import pytest
import torch
from torch.export import Dim

from mlx_delegate.testing import FLOATS, amend, cases, lower_and_compare

# Matrix products accumulate over K: half types get a little more room; float32 keeps its
# own tolerance (K <= 16 here, below where fp32_tolerance(K) grows).
LOOSE = dict(tolerance={torch.float16: (3e-2, 3e-2), torch.bfloat16: (3e-2, 3e-2)})


def randn(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


class Linear(torch.nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 8, bias=bias)

    def forward(self, x):
        return self.fc(x)


# Export specialises sizes 0 and 1, so dynamic ranges start at 2.
batch = Dim("batch", min=2, max=16)

CASES = [
    # linear (kept undecomposed)
    *cases("linear_2d", Linear, randn((4, 16)), FLOATS, is_module=True, **LOOSE),
    *cases("linear_3d", Linear, randn((2, 5, 16)), FLOATS, is_module=True, **LOOSE),
    *cases("linear_no_bias", lambda: Linear(bias=False), randn((3, 16)), FLOATS, is_module=True, **LOOSE),
    *cases("linear_fn_1d_input", lambda x, w, b: torch.nn.functional.linear(x, w, b),
           randn((16,), (8, 16), (8,)), FLOATS, **LOOSE),
    *cases("linear_strided_bias", lambda x, w, b: torch.nn.functional.linear(x, w, b[::2]),
           randn((3, 7, 16), (5, 16), (10,)), FLOATS, **LOOSE),
    # fused with its GELU (fuse_linear_activation): the CPU's bias_act pass reads the bias through its stride
    *cases("linear_gelu_strided_bias", lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b[::2])),
           randn((3, 7, 16), (5, 16), (10,)), FLOATS, **LOOSE),
    *cases("linear_noncontig_input", lambda x, w: torch.nn.functional.linear(x.transpose(0, 1), w),
           randn((16, 4), (8, 16)), FLOATS, **LOOSE),
    *cases("linear_empty_batch", Linear, randn((0, 16)), (torch.float32,), is_module=True),
    # Lowered once per dtype with a token count that may be 1 (a decode step), run at 9 and 1.
    *cases("linear_dynamic", Linear, randn((4, 16)), FLOATS, is_module=True, **LOOSE,
           dynamic_shapes=({0: Dim("tokens", min=1, max=16)},),
           more_inputs=lambda: [(torch.randn(9, 16),), (torch.randn(1, 16),)]),
    # plain products
    *cases("mm", torch.mm, randn((4, 6), (6, 5)), FLOATS, **LOOSE),
    *cases("mm_transposed_operand", lambda a, b: torch.mm(a, b.t()), randn((4, 6), (5, 6)), FLOATS, **LOOSE),
    *cases("mm_zero_k", torch.mm, randn((3, 0), (0, 4)), FLOATS),
    *cases("mm_zero_m", torch.mm, randn((0, 3), (3, 4)), FLOATS),
    *cases("bmm", torch.bmm, randn((3, 4, 6), (3, 6, 5)), FLOATS, **LOOSE),
    *cases("bmm_noncontig", lambda a, b: torch.bmm(a.transpose(0, 1), b), randn((4, 3, 6), (3, 6, 5)),
           FLOATS, **LOOSE),
    *cases("matmul_broadcast_batch", torch.matmul, randn((2, 3, 4, 6), (6, 5)), FLOATS, **LOOSE),
    *cases("matmul_batch_broadcast_both", torch.matmul, randn((2, 1, 4, 6), (3, 6, 5)), FLOATS, **LOOSE),
    *cases("matmul_vec_mat", torch.matmul, randn((6,), (2, 6, 5)), FLOATS, **LOOSE),
    *cases("matmul_mat_vec", torch.matmul, randn((2, 4, 6), (6,)), FLOATS, **LOOSE),
    *cases("matmul_dynamic", torch.matmul, randn((2, 4, 6), (6, 5)), (torch.float32,),
           dynamic_shapes=(({0: batch}, None),), more_inputs=lambda: [randn((7, 4, 6), (6, 5))()]),
    *cases("mv", torch.mv, randn((4, 6), (6,)), FLOATS, **LOOSE),
    *cases("dot", torch.dot, randn((7,), (7,)), FLOATS, **LOOSE),
    # beta * c + alpha * (a @ b)
    *cases("addmm", torch.addmm, randn((5,), (4, 6), (6, 5)), FLOATS, **LOOSE),
    *cases("addmm_alpha_beta", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
           randn((4, 5), (4, 6), (6, 5)), FLOATS, **LOOSE),
    *cases("addmm_int_scalars", lambda c, a, b: torch.addmm(c, a, b, beta=2, alpha=3),
           randn((4, 1), (4, 6), (6, 5)), FLOATS, **LOOSE),
    # beta=0 must ignore c entirely, even its NaNs.
    *cases("addmm_beta0_ignores_nan", lambda c, a, b: torch.addmm(c * float("nan"), a, b, beta=0, alpha=1.5),
           randn((4, 5), (4, 6), (6, 5)), FLOATS, **LOOSE),
    *cases("baddbmm", lambda c, a, b: torch.baddbmm(c, a, b, beta=0.25, alpha=-1.0),
           randn((3, 4, 5), (3, 4, 6), (3, 6, 5)), FLOATS, **LOOSE),
    *cases("baddbmm_broadcast_c", torch.baddbmm, randn((5,), (2, 4, 6), (2, 6, 5)), FLOATS, **LOOSE),
    *cases("addmm_dynamic", torch.addmm, randn((5,), (4, 6), (6, 5)), (torch.float32,),
           dynamic_shapes=((None, {0: batch}, None),), more_inputs=lambda: [randn((5,), (11, 6), (6, 5))()]),
]
# float32 products of a transposed operand: the compiled replay differs from the node-by-node
# result by about 1 ulp (seen: 9.5e-7 on outputs of ~5; the half types agree bit for bit), so
# the two paths are compared to the tolerance instead (compiled_exact=False).
CASES = amend(CASES, dict.fromkeys(["linear_noncontig_input", "mm_transposed_operand"], "operand layout"),
              compiled_exact=False)

# Mixture-of-experts products: rows sorted by expert, offsets the cumulative row counts (an
# empty group included; rows past the last offset are zero, like transformers' fallback).
def _grouped(rows: int, offsets: list[int]) -> Callable[[], tuple]:
    # 8 columns: torch._grouped_mm wants 16-byte strides.
    return lambda: (torch.randn(rows, 8), torch.randn(4, 8, 8), torch.tensor(offsets, dtype=torch.int32))


GROUPED = [
    # torch._grouped_mm exports in bf16 only (its meta kernel's rule); transformers' fp32
    # fallback op of the same contract is covered by the zoo's MoE rows.
    *cases("grouped_mm", lambda x, w, offs: torch._grouped_mm(x, w, offs), _grouped(9, [2, 5, 5, 9]),
           (torch.bfloat16,), **LOOSE),
    *cases("grouped_mm_dynamic", lambda x, w, offs: torch._grouped_mm(x, w, offs), _grouped(9, [2, 5, 5, 9]),
           (torch.bfloat16,), dynamic_shapes=(({0: Dim("s", min=1, max=64)}, None, None),),
           more_inputs=lambda: [tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in make())
                                for make in (_grouped(1, [0, 1, 1, 1]), _grouped(13, [0, 0, 6, 13]))], **LOOSE),
]

# Integer products stay on ExecuTorch (MLX matmul is floating-point only): the
# whole graph is left outside the delegate.
INT_CASES = [
    *cases("mm_int", torch.mm, lambda: (torch.randint(-5, 5, (3, 4)), torch.randint(-5, 5, (4, 2))), (None,),
           segments=0, allowed_fallback=frozenset({"mm"})),
]


@pytest.mark.parametrize("case", CASES + GROUPED + INT_CASES, ids=str)
def test_linalg(case):
    lower_and_compare(case)
