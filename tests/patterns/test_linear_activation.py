"""`fuse_linear_activation`: GELU (erf and tanh forms, also written out) and SiLU reading only a
linear's output become the LinearNode's activation, its bias added in the same pass (in float32 on the
CPU, by the linear kernel on each output block in cache). Matches eager
torch in float32, bfloat16 and float16 (odd sizes, with and without bias, a 2-D and a 3-D input), the
kernels-off path (MLX's add and activation, what GPUs run), the unfused program, and its compiled
replay. A linear whose output is also read elsewhere, and a SwiGLU gate grouped with its up projection,
stay apart."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mlx_delegate
from mlx_delegate import MLXPartitioner
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import (
    FP32_REFERENCE_TOLERANCE, assert_close, compare_node_and_compiled, cpu_kernels_active, delegate_payload,
    fp32_tolerance, lower, runtime_switches,
)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 37)
        self.fc2 = nn.Linear(37, 19, bias=False)
        self.fc3 = nn.Linear(19, 24)
        self.fc4 = nn.Linear(24, 13)
        self.shared = nn.Linear(24, 11)  # its output is also read directly: not fused
        self.gate, self.up = nn.Linear(24, 9, bias=False), nn.Linear(24, 9, bias=False)  # grouped, not fused

    def forward(self, x: torch.Tensor, flat: torch.Tensor) -> list[torch.Tensor]:
        a = F.gelu(self.fc1(x))
        b = F.gelu(self.fc2(a), approximate="tanh")
        c = F.silu(self.fc3(b))
        y = self.fc4(c + 1)  # linears reading one input are grouped first (fuse_linears): inputs differ
        d = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))  # written out: fuse_activations, then this fusion
        s = self.shared(c - 1)
        return [d, F.gelu(s) + s, F.silu(self.gate(c)) * self.up(c), F.gelu(self.fc1(flat))]


def linear_kinds(lowered) -> Counter:
    data, _ = delegate_payload(lowered.edge)
    return Counter(type(i.node).__name__ + (".act" if getattr(i.node, "act", False) else "")
                   for i in N.deserialize(data).instructions if type(i.node).__name__ == "LinearNode")


def bias_act_calls() -> int:
    return mlx_delegate._runtime.cpu_kernel_call_counts().get("bias_act", 0)


def linear_kernel_calls() -> int:
    return mlx_delegate._runtime.cpu_kernel_call_counts().get("linear_f32", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fuse_linear_activation(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Mlp().eval()
    g = torch.Generator().manual_seed(1)
    x, flat = torch.randn(2, 7, 24, generator=g), torch.randn(5, 24, generator=g)
    module = Mlp().eval()
    module.load_state_dict(model.state_dict())
    module = module.to(dtype)
    inputs = (x.to(dtype), flat.to(dtype))
    fused = lower(module, inputs)
    kept = lower(module, inputs, partitioner=MLXPartitioner(disable={"fuse_linear_activation"}))
    assert fused.summary[1] == [] and kept.summary[1] == []
    # fc1 (twice), fc2, fc3 and the written-out GELU's fc4; shared and the gate/up group stay plain
    assert linear_kinds(fused) == Counter({"LinearNode.act": 5, "LinearNode": 2})
    assert linear_kinds(kept)["LinearNode.act"] == 0

    with torch.no_grad():  # float32 on the same (rounded) inputs and parameters
        expected = Mlp().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = expected(*(t.float() for t in inputs))
    rtol, atol = fp32_tolerance(37) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]
    before, linear_before = bias_act_calls(), linear_kernel_calls()
    with runtime_switches(compile=False):
        got = fused.fresh_method().execute(list(inputs))
    # fc2 has no bias: its activation alone. In float32 the linear kernel applies the bias and the activation
    # to each output block of the 14-row products (all six linears); the 5-row fc1(flat) takes the GEMV and the
    # bias_act pass.
    kernel = cpu_kernels_active() and dtype == torch.float32 and mlx_delegate._blas.mode() == "torch"
    assert bias_act_calls() - before == (0 if not cpu_kernels_active() else 1 if kernel else 4)
    assert linear_kernel_calls() - linear_before == (6 if kernel else 0)
    assert_close([t.float() for t in got], reference, rtol, atol)
    with runtime_switches(cpu_kernels=False, compile=False):  # MLX's add, then its activation
        off = fused.fresh_method().execute(list(inputs))
    assert_close([t.float() for t in got], [o.float() for o in off], rtol, atol)
    with runtime_switches(compile=False):
        unfused = kept.fresh_method().execute(list(inputs))
    assert_close([t.float() for t in got], [k.float() for k in unfused], rtol, atol)
    compare_node_and_compiled(fused.buffer, [inputs], lambda *a: [t.to(dtype) for t in reference], rtol, atol)


class HardHead(nn.Module):
    """MobileNetV3's classifier shape: hard-swish after one linear, hard-sigmoid after another (a gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(40, 67), nn.Linear(67, 21, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardsigmoid(self.fc2(F.hardswish(self.fc1(x))))


@pytest.mark.parametrize("rows", [1, 6])  # a GEMV (the classifier at batch 1) and a product
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_hard_activations_fuse(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    model = HardHead().eval()
    # Inputs that put the products across both activations' bends (-3 and 3).
    x = 2 * torch.randn(rows, 40, generator=torch.Generator().manual_seed(1))
    module = HardHead().eval()
    module.load_state_dict(model.state_dict())
    module = module.to(dtype)
    fused = lower(module, (x.to(dtype),))
    kept = lower(module, (x.to(dtype),), partitioner=MLXPartitioner(disable={"fuse_linear_activation"}))
    assert linear_kinds(fused) == Counter({"LinearNode.act": 2})
    assert linear_kinds(kept)["LinearNode.act"] == 0
    with torch.no_grad():
        expected = HardHead().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = [expected(x.to(dtype).float())]
    rtol, atol = fp32_tolerance(67) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]
    with runtime_switches(compile=False):
        got = fused.fresh_method().execute([x.to(dtype)])
    assert_close([t.float() for t in got], reference, rtol, atol)
    with runtime_switches(cpu_kernels=False, compile=False):
        off = fused.fresh_method().execute([x.to(dtype)])
    assert_close([t.float() for t in off], reference, rtol, atol)
    with runtime_switches(compile=False):
        unfused = kept.fresh_method().execute([x.to(dtype)])
    assert_close([t.float() for t in got], [k.float() for k in unfused], rtol, atol)


def test_linear_act_rejects_unknown_activation() -> None:
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        torch.ops.mlx_delegate.linear_act(torch.randn(2, 3), torch.randn(4, 3), None, "relu")
