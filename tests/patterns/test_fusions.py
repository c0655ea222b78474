"""Fusions on the delegated graph (LayerNorm, GELU/SiLU, attention from their
written-out forms): each fires (the IR holds the fused node and nothing of the
decomposed form), matches eager torch in fp32 and bf16, look-alikes stay
unfused and correct, and `MLXPartitioner(disable=...)` restores the unfused IR."""

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import MLXPartitioner
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import TOLERANCE, assert_close, lower

DTYPES = [torch.float32, torch.bfloat16]


def node_kind(node) -> str:
    op = node.act_op if getattr(node, "act", False) else getattr(node, "op", None)  # a LinearNode's fused act
    return type(node).__name__ + (f".{op.name}" if hasattr(op, "name") else "")


def ir_nodes(lowered) -> list:
    ep = lowered.edge.exported_program()
    return [i.node for _, m in ep.graph_module.named_children() if hasattr(m, "processed_bytes")
            for i in N.deserialize(m.processed_bytes).instructions]


def lowered_kinds(module, inputs, disable=()) -> tuple[Counter, list]:
    """Lower (one delegate segment, nothing left outside), check against eager; (IR kinds, IR nodes)."""
    module = module.eval()
    lowered = lower(module, inputs, partitioner=MLXPartitioner(disable=disable))
    assert lowered.summary == (1, []), lowered.summary
    dtype = next(x.dtype for x in inputs if x.is_floating_point())
    with torch.no_grad():
        expected = module(*inputs)
    assert_close(lowered.method().execute(list(inputs)), expected, *TOLERANCE[dtype])
    nodes = ir_nodes(lowered)
    return Counter(node_kind(n) for n in nodes), nodes


# ------------------------------------------------------------------ LayerNorm
class HandLayerNorm(torch.nn.Module):
    """The forms hand-written LayerNorms take: sqrt+div or rsqrt+mul, pow or c*c or var, affine or not."""

    def __init__(self, dim, form, weight=True, bias=True):
        super().__init__()
        self.form = form
        self.weight = torch.nn.Parameter(torch.randn(dim)) if weight else None
        self.bias = torch.nn.Parameter(torch.randn(dim)) if bias else None

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        if self.form == "sqrt":
            y = (x - m) / torch.sqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5)
        elif self.form == "rsqrt":
            c = x - m
            y = c * torch.rsqrt((c * c).mean(-1, keepdim=True) + 1e-6)
        else:  # var
            y = (x - m) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
        if self.weight is not None:
            y = y * self.weight
        return y + self.bias if self.bias is not None else y


LAYER_NORMS = [("sqrt", True, True), ("rsqrt", False, False), ("var", True, False), ("sqrt", False, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form,weight,bias", LAYER_NORMS)
def test_layer_norm_fuses(form, weight, bias, dtype):
    module = HandLayerNorm(32, form, weight, bias).to(dtype)
    kinds, nodes = lowered_kinds(module, (torch.randn(2, 5, 32, dtype=dtype),))
    assert kinds == Counter({"LayerNormNode": 1})
    (ln,) = nodes
    assert (ln.weight is not None, ln.bias is not None) == (weight, bias)


class BesselLayerNorm(HandLayerNorm):
    """Unbiased variance (a different function): must not fuse."""

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        return (x - m) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=True) + 1e-5) * self.weight


class LeakyLayerNorm(HandLayerNorm):
    """The centered input is also returned: fusing would drop a value someone reads."""

    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt((c * c).mean(-1, keepdim=True) + 1e-6), c


@pytest.mark.parametrize("module", [BesselLayerNorm(16, ""), LeakyLayerNorm(16, "")],
                         ids=["unbiased", "leaky"])
def test_layer_norm_lookalikes_stay_unfused(module):
    kinds, _ = lowered_kinds(module, (torch.randn(3, 16),))
    assert "LayerNormNode" not in kinds


# ---------------------------------------------------------------- activations
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
ACTIVATIONS = {
    "gelu_erf": (lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), "UnaryNode.GeluErf"),
    "gelu_erf_halved": (lambda x: x * (1.0 + torch.erf(x * (1 / math.sqrt(2)))) / 2, "UnaryNode.GeluErf"),
    "gelu_tanh": (lambda x: 0.5 * x * (1 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3)))),
                  "UnaryNode.GeluTanh"),
    "gelu_tanh_fast": (lambda x: 0.5 * x * (1 + torch.tanh(x * SQRT_2_OVER_PI * (1 + 0.044715 * x * x))),
                       "UnaryNode.GeluTanh"),
    "silu": (lambda x: x * torch.sigmoid(x), "UnaryNode.Silu"),
    # the hard activations as models write them (relu6 exports as hardtanh) and as torch decomposes them
    "hardswish_relu6": (lambda x: x * F.relu6(x + 3) / 6, "UnaryNode.Hardswish"),
    "hardswish_decomposed": (lambda x: x * torch.clamp(torch.clamp(x + 3, min=0), max=6) / 6,
                             "UnaryNode.Hardswish"),
    "hardsigmoid_relu6": (lambda x: F.relu6(x + 3.0) / 6.0, "UnaryNode.Hardsigmoid"),
    "hardsigmoid_tf": (lambda x: torch.clamp(x * (1 / 6) + 0.5, 0, 1), "UnaryNode.Hardsigmoid"),
}
FUSED_ACTIVATIONS = {"UnaryNode.Silu", "UnaryNode.GeluErf", "UnaryNode.GeluTanh", "UnaryNode.Hardswish",
                     "UnaryNode.Hardsigmoid"}


class Elementwise(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_fuses(name, dtype):
    fn, kind = ACTIVATIONS[name]
    kinds, _ = lowered_kinds(Elementwise(fn), (torch.randn(4, 64, dtype=dtype) * 4,))
    assert kinds == Counter({kind: 1})


class Gated(torch.nn.Module):
    """SwiGLU / GeGLU: act(a) * b needs only the fused activation and one multiply."""

    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        a, b = x.chunk(2, -1)
        return self.act(a) * b


@pytest.mark.parametrize("act,kind", [(ACTIVATIONS["silu"][0], "UnaryNode.Silu"),
                                      (ACTIVATIONS["gelu_tanh"][0], "UnaryNode.GeluTanh")],
                         ids=["swiglu", "geglu"])
def test_gated_activation_is_one_unary_and_one_multiply(act, kind):
    kinds, _ = lowered_kinds(Gated(act), (torch.randn(3, 64),))
    assert kinds[kind] == 1 and kinds["BinaryNode.Mul"] == 1
    assert not {"UnaryNode.Sigmoid", "UnaryNode.Tanh", "UnaryNode.Erf"} & set(kinds)


class SharedSigmoid(torch.nn.Module):
    def forward(self, x):
        s = torch.sigmoid(x)
        return x * s, s


ACTIVATION_LOOKALIKES = {
    "quick_gelu": Elementwise(lambda x: x * torch.sigmoid(1.702 * x)),
    "wrong_constant": Elementwise(lambda x: 0.5 * x * (1 + torch.erf(x / 1.5))),
    "sigmoid_read_elsewhere": SharedSigmoid(),
    "relu6_shift_over_5": Elementwise(lambda x: F.relu6(x + 3) / 5),
    "hardswish_shift_2": Elementwise(lambda x: x * F.relu6(x + 2) / 6),
}


@pytest.mark.parametrize("name", list(ACTIVATION_LOOKALIKES))
def test_activation_lookalikes_stay_unfused(name):
    kinds, _ = lowered_kinds(ACTIVATION_LOOKALIKES[name], (torch.randn(4, 64) * 4,))
    assert not FUSED_ACTIVATIONS & set(kinds)


# ------------------------------------------------------------------ attention
def scores(q, k, scale_form):
    if scale_form == "div":
        return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if scale_form == "mul":
        return torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    return (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)  # query pre-scaled


class AdditiveMask(torch.nn.Module):
    def __init__(self, scale_form="mul"):
        super().__init__()
        self.scale_form = scale_form

    def forward(self, q, k, v, mask):
        return torch.softmax(scores(q, k, self.scale_form) + mask, dim=-1) @ v


class ComputedMaskFirst(AdditiveMask):
    """mask + scores, the mask itself a scaled tensor: the scores are told apart by their matmul."""

    def forward(self, q, k, v, mask):
        return torch.softmax(mask * 2.0 + scores(q, k, "mul"), dim=-1) @ v


def test_attention_with_computed_mask_first_fuses():
    _, nodes = lowered_kinds(ComputedMaskFirst(), (*qkv(torch.float32), torch.randn(1, 1, 8, 8)))
    assert sum(type(n).__name__ == "SdpaNode" for n in nodes) == 1 and len(nodes) == 2  # mask * 2, SDPA


class CausalBuffer(torch.nn.Module):
    """nanoGPT: masked_fill with a slice of a constant lower-triangular buffer."""

    def __init__(self, ctx=16, triangle=torch.tril):
        super().__init__()
        self.register_buffer("bias", triangle(torch.ones(ctx, ctx)).view(1, 1, ctx, ctx))

    def forward(self, q, k, v):
        t = q.shape[2]
        att = scores(q, k, "div").masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class PositionMask(torch.nn.Module):
    """A boolean keep-mask built from an input (decode step over a cache), filled with -1e9."""

    def forward(self, q, k, v, pos):
        keep = torch.arange(k.shape[2]) <= pos
        att = scores(q, k, "div")
        return torch.where(keep, att, torch.full_like(att, -1e9)).softmax(-1) @ v


class GroupedQuery(torch.nn.Module):
    """HF eager attention: repeat_kv / repeat_interleave, softmax in float32, cast back."""

    def forward(self, q, k, v):
        b, h, s, d = k.shape
        k = k[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)
        v = v.repeat_interleave(2, dim=1)
        w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * d**-0.5, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)


def qkv(dtype, heads=4, kv_heads=4, length=8, keys=8, dim=16):
    return (torch.randn(1, heads, length, dim, dtype=dtype), torch.randn(1, kv_heads, keys, dim, dtype=dtype),
            torch.randn(1, kv_heads, keys, dim, dtype=dtype))


def only_sdpa(nodes):
    (sdpa,) = nodes
    assert type(sdpa).__name__ == "SdpaNode"
    return sdpa


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale_form", ["div", "mul", "pre_scaled_q"])
def test_attention_with_additive_mask_fuses(scale_form, dtype):
    mask = torch.randn(1, 1, 8, 8, dtype=dtype)
    _, nodes = lowered_kinds(AdditiveMask(scale_form), (*qkv(dtype), mask))
    sdpa = only_sdpa(nodes)
    assert sdpa.mask is not None and not sdpa.causal and sdpa.scale == pytest.approx(16**-0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_triangle_becomes_is_causal(dtype):
    sdpa = only_sdpa(lowered_kinds(CausalBuffer(), qkv(dtype))[1])
    assert sdpa.causal and sdpa.mask is None


def test_non_causal_constant_mask_stays_a_mask():
    kinds, nodes = lowered_kinds(CausalBuffer(triangle=lambda t: torch.triu(t)), qkv(torch.float32, length=8))
    sdpa = next(n for n in nodes if type(n).__name__ == "SdpaNode")
    assert not sdpa.causal and sdpa.mask is not None and kinds["UnaryNode.LogicalNot"] == 1


def test_boolean_mask_from_an_input_fuses():
    kinds, nodes = lowered_kinds(PositionMask(), (*qkv(torch.float32, length=1, keys=12), torch.tensor(5)))
    assert kinds["SdpaNode"] == 1 and "UnaryNode.Softmax" not in kinds and "MatmulNode" not in kinds


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_query_attention_uses_unrepeated_kv(dtype):
    q, k, v = qkv(dtype, heads=4, kv_heads=2)
    assert only_sdpa(lowered_kinds(GroupedQuery(), (q, k, v))[1])


class SoftmaxOverQueries(AdditiveMask):
    def forward(self, q, k, v, mask):
        return torch.softmax(scores(q, k, "mul") + mask, dim=-2) @ v


class DropoutLike(AdditiveMask):
    def forward(self, q, k, v, mask):
        return (torch.softmax(scores(q, k, "mul") + mask, dim=-1) * 0.9) @ v


class ScaledAfterMask(AdditiveMask):
    def forward(self, q, k, v, mask):
        return torch.softmax((q @ k.transpose(-2, -1) + mask) * 0.25, dim=-1) @ v


class SmallFill(AdditiveMask):
    def forward(self, q, k, v, mask):
        return torch.softmax(scores(q, k, "mul").masked_fill(mask > 0, -1.0), dim=-1) @ v


class ScoresReturned(AdditiveMask):
    def forward(self, q, k, v, mask):
        s = scores(q, k, "mul") + mask
        return torch.softmax(s, dim=-1) @ v, s


@pytest.mark.parametrize("module", [SoftmaxOverQueries(), DropoutLike(), ScaledAfterMask(), SmallFill(),
                                    ScoresReturned()], ids=lambda m: type(m).__name__)
def test_attention_lookalikes_stay_unfused(module):
    kinds, _ = lowered_kinds(module, (*qkv(torch.float32), torch.randn(1, 1, 8, 8)))
    assert "SdpaNode" not in kinds


# ------------------------------------------------------------------ switches
class Block(torch.nn.Module):
    """One of each: LayerNorm, attention, GELU, a linear's SiLU."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.norm = heads, HandLayerNorm(dim, "sqrt")
        self.qkv, self.fc, self.up = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = (torch.softmax(scores(q, k, "div") + mask, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        return ACTIVATIONS["gelu_erf"][0](self.fc(a) + x), torch.nn.functional.silu(self.up(x))


FUSED_KIND = {"fuse_layer_norm": "LayerNormNode", "fuse_activations": "UnaryNode.GeluErf",
              "fuse_attention": "SdpaNode", "fuse_linear_activation": "LinearNode.Silu"}


def test_switching_fusions_off_restores_the_unfused_ir():
    torch.manual_seed(0)
    block, inputs = Block(), (torch.randn(2, 6, 32), torch.randn(1, 1, 6, 6))
    fused, _ = lowered_kinds(block, inputs)
    unfused, _ = lowered_kinds(block, inputs, disable={"fusions"})
    assert all(fused[k] == 1 for k in FUSED_KIND.values())
    assert not set(FUSED_KIND.values()) & set(unfused)
    assert sum(unfused.values()) > sum(fused.values()) + 10
    for name, kind in FUSED_KIND.items():
        one_off, _ = lowered_kinds(block, inputs, disable={name})
        assert kind not in one_off and all(one_off[k] == 1 for k in FUSED_KIND.values() if k != kind), name
