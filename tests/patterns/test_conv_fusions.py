"""Convolution fusions. `fold_batch_norm`: eval-mode BatchNorm after a convolution is folded into the convolution's weight
and bias (no BatchNormNode left), and the result matches eager torch in float32, bfloat16 and
float16, and the unfolded program (disable={"fold_batch_norm"}): with and without the convolution's
own bias, affine and non-affine BatchNorm, 1-D and grouped convolutions. A BatchNorm whose input is
also read elsewhere, or after a transposed convolution, stays. `fuse_conv_activation`: ReLU, ReLU6,
hardtanh and clamp after a convolution become the ConvNode's clamp, matching eager torch, MLX's own
convolution (kernels off) and the unfused program. Hard-swish, hard-sigmoid, SiLU and GELU become its
`act` and squeeze-excite gates (x * s, s [N, C, 1, 1]) its `in_scale` (`fuse_conv_scale`), likewise."""

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


class PadResidual(nn.Module):
    """Zero pads folded into the next convolution (asymmetric TF-style "same", a 1-D pad, dilation
    and groups) and residual adds fused into it (then ReLU, or nothing); and look-alikes that stay:
    a non-zero pad, a pad also read elsewhere, an add that broadcasts, a ReLU before the add."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(6, 6, 3, stride=2, groups=6)          # after ZeroPad2d((0, 1, 0, 1))
        self.grouped = nn.Conv2d(6, 4, 3, dilation=2, groups=2)   # after F.pad((1, 2, 2, 1))
        self.res = nn.Conv2d(6, 6, 3, padding=1)                  # relu(res(a) + a)
        self.res_plain = nn.Conv2d(6, 6, 1, bias=False)           # res_plain(a) + a, no activation
        self.c1 = nn.Conv1d(6, 6, 3, padding=1)                   # 1-D pad (2, 0), then + residual
        self.kept = nn.Conv2d(6, 6, 3)                            # non-zero pad, broadcast add, relu before add

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        a = self.dw(F.pad(x, (0, 1, 0, 1)))
        b = self.grouped(F.pad(a, (1, 2, 2, 1)))
        c = torch.relu(self.res(a) + a)
        d = self.res_plain(c) + c
        e = self.c1(F.pad(d.flatten(2), (2, 0))) + d.flatten(2)[..., :1].expand(-1, -1, d.shape[2] * d.shape[3] + 2)
        shared = F.pad(a, (1, 1, 1, 1))
        f = torch.relu(self.kept(F.pad(a, (1, 1, 1, 1), value=0.5))) + a
        g = self.kept(shared) + shared.mean((2, 3), keepdim=True)
        return [b, c, d, e, f, g]


def conv_inputs(lowered) -> Counter:
    data, _ = delegate_payload(lowered.edge)
    kinds = Counter()
    for i in N.deserialize(data).instructions:
        node = i.node
        kinds[type(node).__name__] += 1
        if type(node).__name__ == "ConvNode":
            kinds["padding_hi"] += node.padding_hi is not None and list(node.padding_hi) != list(node.padding or [])
            kinds["residual"] += node.residual is not None
            kinds["clamp"] += bool(node.clamp)
    return kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fold_pad_and_residual(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = PadResidual().eval()
    x = torch.randn(2, 6, 13, 11, generator=torch.Generator().manual_seed(1))
    module = PadResidual().eval()
    module.load_state_dict(model.state_dict())
    module = module.to(dtype)
    fused = lower(module, (x.to(dtype),))
    kept = lower(module, (x.to(dtype),), partitioner=MLXPartitioner(disable={"fold_conv_pad", "fuse_conv_residual"}))
    assert fused.summary[1] == [] and kept.summary[1] == []
    kinds, before = conv_inputs(fused), conv_inputs(kept)
    # Pads left: the non-zero one and the shared one; asymmetric padding on dw, grouped and c1.
    assert kinds["PadNode"] == 2 and before["PadNode"] == 5
    assert kinds["padding_hi"] == 3 and before["padding_hi"] == 0
    # Residuals on res, res_plain and c1 (e's expand is the right shape); the kept adds stay.
    assert kinds["residual"] == 3 and before["residual"] == 0
    assert kinds["clamp"] == 2 and before["clamp"] == 1  # relu(res + a) joins kept's relu

    with torch.no_grad():
        expected = PadResidual().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = expected(x.to(dtype).float())
    rtol, atol = fp32_tolerance(108) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]
    got = fused.method().execute([x.to(dtype)])
    assert_close([g.float() for g in got], reference, rtol, atol)
    with runtime_switches(cpu_kernels=False):  # MLX's convolution with pad_lo != pad_hi, then add and clip
        off = fused.fresh_method().execute([x.to(dtype)])
    assert_close([g.float() for g in got], [o.float() for o in off], rtol, atol)
    assert_close([g.float() for g in got], [k.float() for k in kept.method().execute([x.to(dtype)])], rtol, atol)


class ActScale(nn.Module):
    """Activations in the convolution's epilogue: hard-swish after a 3x3 and after a 5x5 stride-2
    depthwise with padding 2, a squeeze-excite gate closed by hard-sigmoid, SiLU, GELU. The gate folded
    into the next convolution as its input scale: into the weights (a 1x1 with a residual, smaller than
    its input), into the input (a 3x3 with more weights than the input has values), into a depthwise
    convolution. A wide 1-D depthwise convolution with a residual and ReLU6 (the sixteen-lane rows).
    Look-alikes that stay: an activation whose convolution output is also read, a gated
    product also read elsewhere, a scale shared by both images ([1, C, 1, 1])."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 5, stride=2, padding=2, groups=8)
        self.squeeze, self.excite = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.project = nn.Conv2d(8, 8, 1)
        self.wide = nn.Conv2d(8, 16, 3, padding=1)
        self.dw3 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.shared = nn.Conv2d(8, 8, 1)
        self.dw1d = nn.Conv1d(3, 3, 5, padding=2, groups=3)
        self.layer_scale = nn.Parameter(torch.rand(1, 8, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        a = F.hardswish(self.stem(x))
        b = F.hardswish(self.dw(a))
        gate = F.hardsigmoid(self.excite(F.relu(self.squeeze(b.mean((2, 3), keepdim=True)))))
        c = self.project(b * gate) + b
        d = F.silu(self.wide(F.avg_pool2d(c, 3) * gate))
        e = F.gelu(self.dw3(c * gate))
        s = self.shared(c)
        p = c * gate
        wide = F.relu6(self.dw1d(x.flatten(2)) + x.flatten(2))
        return [d, e, F.hardswish(s) + s, self.project(p) + p, self.project(c * self.layer_scale), wide]


def conv_epilogues(lowered) -> Counter:
    data, _ = delegate_payload(lowered.edge)
    kinds = Counter()
    for i in N.deserialize(data).instructions:
        if type(i.node).__name__ == "ConvNode":
            kinds["act." + i.node.act_op.name if i.node.act else "no act"] += 1
            kinds["in_scale"] += i.node.in_scale is not None
        else:
            kinds[type(i.node).__name__] += 1
    return kinds


def _in_dtype(cls: type[nn.Module], x: torch.Tensor, dtype: torch.dtype) -> tuple[nn.Module, list[torch.Tensor]]:
    """A `cls` in `dtype` to lower, and eager's outputs in fp32 from the same weights rounded to `dtype`."""
    torch.manual_seed(0)
    model = cls().eval()
    module = cls().eval()
    module.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = cls().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = expected(x.to(dtype).float())
    return module.to(dtype), reference


def _check_fused(fused, x: torch.Tensor, reference: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The fused program against eager and against itself with the CPU kernels off (MLX's own ops)."""
    rtol, atol = fp32_tolerance(200) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]
    got = [g.float() for g in fused.method().execute([x.to(dtype)])]
    assert_close(got, reference, rtol, atol)
    with runtime_switches(cpu_kernels=False):
        off = fused.fresh_method().execute([x.to(dtype)])
    assert_close(got, [o.float() for o in off], rtol, atol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fuse_conv_act_and_scale(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 13, 11, generator=torch.Generator().manual_seed(1)) * 2
    module, reference = _in_dtype(ActScale, x, dtype)
    fused = lower(module, (x.to(dtype),))
    kept = lower(module, (x.to(dtype),), partitioner=MLXPartitioner(disable={"fuse_conv_activation",
                                                                             "fuse_conv_scale"}))
    assert fused.summary[1] == [] and kept.summary[1] == []
    kinds, before = conv_epilogues(fused), conv_epilogues(kept)
    assert {k: v for k, v in kinds.items() if k.startswith("act.")} == {
        "act.Hardswish": 2, "act.Hardsigmoid": 1, "act.Silu": 1, "act.GeluErf": 1}
    # Left as nodes: hardswish(s) and the add after it, and the two look-alike products.
    assert kinds["in_scale"] == 3 and kinds["UnaryNode"] == 1 and kinds["BinaryNode"] == 3
    assert before["in_scale"] == 0 and not any(k.startswith("act.") for k in before)
    got = _check_fused(fused, x, reference, dtype)
    rtol, atol = fp32_tolerance(200) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]
    assert_close(got, [k.float() for k in kept.method().execute([x.to(dtype)])], rtol, atol)


class PointwiseActs(nn.Module):
    """1x1 convolutions with their activation fused, over small maps of one image, whose output rows are
    dense (each channel's plane in one run: the activation then takes a block of channels at once): a
    head-like 7x7 hard-swish (MobileNetV3's last convolution, narrowed), SiLU over 5x9, GELU over 3x3."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Conv2d(40, 96, 1)
        self.silu = nn.Conv2d(96, 48, 1)
        self.gelu = nn.Conv2d(48, 24, 1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = F.hardswish(self.head(x))
        s = F.silu(self.silu(F.interpolate(h, size=(5, 9))))
        return [h, s, F.gelu(self.gelu(s[:, :, 1:4, 2:5]))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_pointwise_conv_activation_over_dense_rows(dtype: torch.dtype) -> None:
    x = torch.randn(1, 40, 7, 7, generator=torch.Generator().manual_seed(2)) * 2
    module, reference = _in_dtype(PointwiseActs, x, dtype)
    fused = lower(module, (x.to(dtype),))
    assert fused.summary[1] == []
    assert {k: v for k, v in conv_epilogues(fused).items() if k.startswith("act.")} == {
        "act.Hardswish": 1, "act.Silu": 1, "act.GeluErf": 1}
    _check_fused(fused, x, reference, dtype)
