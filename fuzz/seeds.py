"""Real delegate payloads to seed the payload fuzzer: small programs lowered at start-up."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate.testing import delegate_payload, lower

# IR dtype names (schema `DType`) for the tensor dtypes the seeds use.
IR_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64",
             torch.int32: "i32", torch.bool: "bool_"}
TORCH_DTYPES = {v: k for k, v in IR_DTYPES.items()}

TensorArg = tuple[str, list[int], bytes]


@dataclass
class Seed:
    name: str
    payload: bytes
    named_data: dict[str, bytes]
    inputs: list[TensorArg]
    expected: list[torch.Tensor]  # eager outputs for `inputs`
    pte: bytes = b""  # the whole lowered program, as the stock runtime loads it


def to_arg(t: torch.Tensor) -> TensorArg:
    t = t.contiguous()
    return IR_DTYPES[t.dtype], list(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def from_arg(arg: Any) -> Any:
    if not isinstance(arg, tuple):
        return arg
    dtype, shape, data = arg
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(TORCH_DTYPES[dtype]).reshape(shape)


class Elementwise(torch.nn.Module):
    def forward(self, x, y):
        return torch.tanh(torch.exp(x) * y + 1.0) - torch.sigmoid(y)


class Matmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)

    def forward(self, x, w):
        return torch.relu(self.fc(x)) @ w


class Conv(torch.nn.Module):
    """A convolution, then an inverted-residual block (expand + ReLU6, depthwise + ReLU6, project, + input:
    one InvertedResidualNode), then max pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.expand = torch.nn.Conv2d(4, 8, 1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.project = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        y = y + self.project(F.relu6(self.dw(F.relu6(self.expand(y)))))
        return F.max_pool2d(y, 2).sum(dim=1)


class Dynamic(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 2.0, dim=-1).reshape(-1, 2, x.shape[-1] // 2).mean(dim=1)


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.full((4,), 10.0))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Heads back to [b, s, d] by unbind + cat, so the fuzzer mutates that path; the usual
        # transpose + reshape lowers too (tests/models/test_vision.py, tests/patterns/test_fusions.py).
        return x + self.out(torch.cat(y.unbind(1), dim=-1))


def _cases() -> list[tuple[str, Callable[[], torch.nn.Module], tuple, Any]]:
    n = Dim("n", min=2, max=32)
    return [
        ("elementwise", Elementwise, (torch.randn(3, 4), torch.randn(3, 4)), None),
        ("matmul", Matmul, (torch.randn(5, 8), torch.randn(6, 3)), None),
        ("conv", Conv, (torch.randn(1, 3, 8, 8),), None),
        ("dynamic", Dynamic, (torch.randn(3, 8),), ({0: n},)),
        ("buffer", Counter, (torch.randn(4),), None),
        ("attention", Attention, (torch.randn(1, 5, 16),), None),
    ]


def seed_inputs_by_name() -> dict[str, list[torch.Tensor]]:
    """Every seed program's example inputs, without lowering (replaying saved mutants needs only these)."""
    torch.manual_seed(0)
    return {name: list(inputs) for name, _, inputs, _ in _cases()}


def build_seeds() -> list[Seed]:
    """Lower every seed program (one delegate segment each) and record eager outputs."""
    torch.manual_seed(0)
    seeds = []
    for name, make, inputs, dynamic in _cases():
        module = make().eval()
        eager = copy.deepcopy(module)  # lowering must not see state the eager run changed
        lowered = lower(module, inputs, dynamic_shapes=dynamic)
        assert lowered.summary == (1, []), (name, lowered.summary)
        payload, named = delegate_payload(lowered.edge)
        with torch.no_grad():
            out = eager(*inputs)
        expected = list(out) if isinstance(out, (tuple, list)) else [out]
        seeds.append(Seed(name, payload, named, [to_arg(x) for x in inputs], expected, lowered.buffer))
    return seeds
