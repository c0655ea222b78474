"""Small vision models end to end: each must lower into exactly one delegate
segment (no op left to ExecuTorch) and match eager PyTorch.

The models are random-weight miniatures of common architectures: a ResNet
(conv, batch norm, residual, max pool, global average pool, linear head), a
ViT (patch conv, layer norm, matmul/softmax attention, GELU MLP) and a UNet
stage (conv, group norm, SiLU, nearest upsampling, skip concatenation).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from mlx_delegate.testing import FLOATS, cases, lower_and_compare

# Deep stacks of accumulations: half types get more room than single ops.
HALF_TOLERANCE = {torch.float32: {}, torch.float16: dict(rtol=5e-2, atol=5e-2),
                  torch.bfloat16: dict(rtol=1e-1, atol=1e-1)}


def randomize(module: nn.Module) -> nn.Module:
    """Random normalisation parameters and statistics, so that no layer is an identity."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return module.eval()


# ---------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        self.layers = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


# ------------------------------------------------------------------------- ViT
class Attention(nn.Module):
    """Multi-head self-attention written out with matmul and softmax."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, image: int = 16, patch: int = 4, dim: int = 32, heads: int = 4, depth: int = 2,
                 classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1) + self.pos
        return self.head(self.norm(self.blocks(tokens))[:, 0])


# ------------------------------------------------------------------------ UNet
class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyUNet(nn.Module):
    """One down/up stage: encoder, strided-conv downsampling, bottleneck, nearest upsampling, skip concat."""

    def __init__(self, cin: int = 3, width: int = 8) -> None:
        super().__init__()
        self.enc = ConvBlock(cin, width)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.mid = ConvBlock(2 * width, 2 * width)
        self.reduce = nn.Conv2d(2 * width, width, 1)
        self.dec = ConvBlock(2 * width, width)
        self.out = nn.Conv2d(width, cin, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        y = self.reduce(F.interpolate(self.mid(self.down(skip)), scale_factor=2, mode="nearest"))
        return self.out(self.dec(torch.cat([y, skip], dim=1)))


def image(*shape: int):
    return lambda: (torch.randn(*shape),)


def model_cases(name: str, make, shape: tuple[int, ...], **kw) -> list:
    return [c for dt in FLOATS
            for c in cases(name, lambda: randomize(make()), image(*shape), (dt,), is_module=True,
                           **HALF_TOLERANCE[dt], **kw)]


batch = Dim("batch", min=2, max=8)

CASES = [
    *model_cases("resnet", TinyResNet, (2, 3, 32, 32)),
    *model_cases("vit", TinyViT, (2, 3, 16, 16)),
    *model_cases("unet", TinyUNet, (1, 3, 16, 16)),
    *cases("resnet_dynamic_batch", lambda: randomize(TinyResNet()), image(2, 3, 32, 32), (torch.float32,),
           is_module=True, dynamic_shapes=({0: batch},), more_inputs=lambda: [image(5, 3, 32, 32)()]),
    *cases("unet_dynamic_batch", lambda: randomize(TinyUNet()), image(2, 3, 16, 16), (torch.float32,),
           is_module=True, dynamic_shapes=({0: batch},), more_inputs=lambda: [image(3, 3, 16, 16)()]),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_vision(case):
    lower_and_compare(case)
