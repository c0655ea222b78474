"""Convolution fusions. `fold_batch_norm`: eval-mode BatchNorm after a convolution is folded into the convolution's weight
and bias (no BatchNormNode left), and the result matches eager torch in float32, bfloat16 and
float16, and the unfolded program (disable={"fold_batch_norm"}): with and without the convolution's
own bias, affine and non-affine BatchNorm, 1-D and grouped convolutions. A BatchNorm whose input is
also read elsewhere, or after a transposed convolution, stays. `fuse_conv_activation`: ReLU, ReLU6,
hardtanh and clamp after a convolution become the ConvNode's clamp, matching eager torch, MLX's own
convolution (kernels off) and the unfused program."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlx_delegate import MLXPartitioner
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import (
    FP32_REFERENCE_TOLERANCE, assert_close, delegate_payload, fp32_tolerance, lower, runtime_switches,
)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, groups=4, bias=True), nn.BatchNorm2d(8, affine=False))
        self.c = nn.Sequential(nn.Conv1d(3, 5, 3), nn.BatchNorm1d(5))
        self.shared = nn.Conv2d(8, 4, 1)  # its output is also read directly: not folded
        self.bn_shared = nn.BatchNorm2d(4)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)  # transposed: not folded
        self.bn_up = nn.BatchNorm2d(4)
        g = torch.Generator().manual_seed(0)
        for bn in self.modules():  # non-trivial statistics and affine parameters
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.running_mean.copy_(torch.randn(bn.num_features, generator=g))
                bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
                if bn.affine:
                    bn.weight.data.copy_(torch.randn(bn.num_features, generator=g))
                    bn.bias.data.copy_(torch.randn(bn.num_features, generator=g))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        a = self.a(x)
        s = self.shared(a)
        return [self.b(a), self.c(x.flatten(2)), self.bn_shared(s) + s, self.bn_up(self.up(a))]


def batch_norms(lowered) -> int:
    data, _ = delegate_payload(lowered.edge)
    return sum(type(i.node).__name__ == "BatchNormNode" for i in N.deserialize(data).instructions)


@pytest.fixture(scope="module")
def model() -> Blocks:
    return Blocks().eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fold_batch_norm(model: Blocks, dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 9, 7, generator=torch.Generator().manual_seed(1))
    module = Blocks().eval()
    module.load_state_dict(model.state_dict())
    module = module.to(dtype)
    folded = lower(module, (x.to(dtype),))
    kept = lower(module, (x.to(dtype),), partitioner=MLXPartitioner(disable={"fold_batch_norm"}))
    assert folded.summary[1] == [] and kept.summary[1] == []
    assert batch_norms(kept) == 5
    assert batch_norms(folded) == 2  # the shared and the transposed convolution's

    with torch.no_grad():  # float32 on the same (rounded) inputs and parameters
        expected = Blocks().eval()
        expected.load_state_dict({k: v.to(dtype).float() if v.is_floating_point() else v
                                  for k, v in model.state_dict().items()})
        reference = expected(x.to(dtype).float())
    rtol, atol = fp32_tolerance(72) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]
    got = folded.method().execute([x.to(dtype)])
    assert_close([g.float() for g in got], reference, rtol, atol)
    assert_close([g.float() for g in got], [k.float() for k in kept.method().execute([x.to(dtype)])], rtol, atol)


class Activations(nn.Module):
    """Convolutions followed by ReLU, ReLU6, hardtanh and clamp (fused), and two that stay apart: a
    ReLU whose convolution output is also read, and a transposed convolution's ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, stride=2, groups=6),
                                    nn.Conv2d(6, 5, 1, bias=False), nn.Conv1d(3, 4, 3)])
        self.shared = nn.Conv2d(6, 4, 1)
        self.up = nn.ConvTranspose2d(6, 2, 2, stride=2)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        a = torch.relu(self.convs[0](x))
        b = F.relu6(self.convs[1](a))
        c = F.hardtanh(self.convs[2](a), -0.5, 0.25)
        d = torch.clamp(self.convs[3](x.flatten(2)), min=-0.1)
        s = self.shared(a)
        return [b, c, d, torch.relu(s) + s, torch.relu(self.up(a))]


def node_kinds(lowered) -> Counter:
    data, _ = delegate_payload(lowered.edge)
    kinds = Counter()
    for i in N.deserialize(data).instructions:
        kinds[type(i.node).__name__ + (".clamp" if getattr(i.node, "clamp", False) else "")] += 1
    return kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fuse_conv_activation(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Activations().eval()
    x = torch.randn(2, 3, 9, 7, generator=torch.Generator().manual_seed(1))
    module = Activations().eval()
    module.load_state_dict(model.state_dict())
    module = module.to(dtype)
    fused = lower(module, (x.to(dtype),))
    kept = lower(module, (x.to(dtype),), partitioner=MLXPartitioner(disable={"fuse_conv_activation"}))
    assert fused.summary[1] == [] and kept.summary[1] == []
    assert node_kinds(fused)["ConvNode.clamp"] == 4 and node_kinds(fused)["ConvNode"] == 2
    assert node_kinds(kept)["ConvNode.clamp"] == 0

    with torch.no_grad():
        expected = Activations().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = expected(x.to(dtype).float())
    rtol, atol = fp32_tolerance(54) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]
    got = fused.method().execute([x.to(dtype)])
    assert_close([g.float() for g in got], reference, rtol, atol)
    with runtime_switches(cpu_kernels=False):  # MLX's convolution, then its clip
        off = fused.fresh_method().execute([x.to(dtype)])
    assert_close([g.float() for g in got], [o.float() for o in off], rtol, atol)
    assert_close([g.float() for g in got], [k.float() for k in kept.method().execute([x.to(dtype)])], rtol, atol)
