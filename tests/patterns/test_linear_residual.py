"""`fuse_linear_residual`: `r + linear(x)` (either operand order, with and without a bias, and through
`nn.MultiheadAttention`'s batch-first views at batch 1) becomes the LinearNode's residual, added to
each output block in cache by the CPU linear kernel. Matches eager torch in float32, bfloat16 and
float16 node by node, compiled and with the CPU kernels off (MLX's adds, what GPUs run), at a size
the kernel cuts into blocks and with a strided residual; a broadcast residual and a linear whose
output is also read elsewhere stay unfused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlx_delegate import MLXPartitioner, _blas, _runtime
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import FLOATS, cases, cpu_kernels_active, delegate_payload, fp32_tolerance, lower, \
    lower_and_compare

HALF = {torch.float16: (3e-2, 3e-2), torch.bfloat16: (6e-2, 6e-2)}


class Residuals(nn.Module):
    """Three fusable residual adds and two that must stay apart."""

    def __init__(self, d: int = 40) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.fc3, self.fc4 = nn.Linear(d, d), nn.Linear(d, d)
        self.row = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x + self.fc1(x)  # residual first
        y = self.fc2(y) + y  # residual second, no bias
        y = y + self.attn(y, y, y, need_weights=False)[0]  # out_proj's result through view + transpose
        s = self.fc4(y)
        return self.fc3(y) + self.row, s + y, s * 2  # a broadcast residual; s is read twice


class Big(nn.Module):
    """A linear large enough to be cut into blocks (2.2M multiply-adds), its residual a strided view."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(160, 200)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return r.transpose(0, 1) + self.fc(x)


def tol(k: int) -> dict:
    return {"tolerance": {torch.float32: fp32_tolerance(k), **HALF}}


CASES = [
    *cases("residuals", Residuals, lambda: (torch.randn(1, 9, 40),), FLOATS, is_module=True, **tol(40)),
    *cases("big_strided", Big, lambda: (torch.randn(70, 160) / 4, torch.randn(200, 70)), FLOATS, is_module=True,
           **tol(160)),
]
FUSED = {"residuals": 3, "big_strided": 1}


def residual_linears(lowered) -> Counter:
    data, _ = delegate_payload(lowered.edge)
    return Counter("residual" if i.node.residual is not None else "plain"
                   for i in N.deserialize(data).instructions if isinstance(i.node, N.LinearNode))


def kernel_calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("linear_f32", 0)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_linear_residual(case) -> None:
    before = kernel_calls()
    lowered = lower_and_compare(case)
    name = case.name.rsplit("-", 1)[0]
    assert residual_linears(lowered)["residual"] == FUSED[name]
    if case.dtype == torch.float32 and cpu_kernels_active() and _blas.mode() == "torch":
        assert kernel_calls() - before >= 2 * FUSED[name]  # node by node and the compiled trace
    elif case.dtype != torch.float32:
        assert kernel_calls() == before


def test_switched_off_keeps_the_adds() -> None:
    torch.manual_seed(0)
    module, inputs = Residuals().eval(), (torch.randn(1, 9, 40),)
    kept = lower(module, inputs, partitioner=MLXPartitioner(disable={"fuse_linear_residual"}))
    assert residual_linears(kept)["residual"] == 0
    got = kept.fresh_method().execute(list(inputs))
    with torch.no_grad():
        want = module(*inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=fp32_tolerance(40)[1])


def test_linear_residual_op_matches_its_definition() -> None:
    x, w, b, r = torch.randn(3, 5), torch.randn(4, 5), torch.randn(4), torch.randn(3, 4)
    torch.testing.assert_close(torch.ops.mlx_delegate.linear_residual(x, w, b, r), F.linear(x, w, b) + r)
