"""Linears reading one input (q/k/v, gate/up) fuse into one product over the
stacked weights plus slices: the IR holds one LinearNode per group, results
match eager torch in fp32 and bf16 (2-D and 3-D inputs, with, without and with
mixed biases, GQA sizes), the stacked weight is stored instead of its parts,
non-constant weights stay unfused, and `disable={"fuse_linears"}` restores
one LinearNode per linear."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import MLXPartitioner
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import TOLERANCE, assert_close, delegate_payload, lower

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN = 64


class Qkv(torch.nn.Module):
    """Attention's projections with GQA sizes (8 query heads, 2 kv heads of 8)."""

    def __init__(self, bias: str = "none"):
        super().__init__()
        has = {"none": (False,) * 3, "all": (True,) * 3, "mixed": (False, True, False)}[bias]
        self.q = torch.nn.Linear(HIDDEN, 64, bias=has[0])
        self.k = torch.nn.Linear(HIDDEN, 16, bias=has[1])
        self.v = torch.nn.Linear(HIDDEN, 16, bias=has[2])

    def forward(self, x):
        return self.q(x) * 2, self.k(x).relu(), self.v(x)


class GateUp(torch.nn.Module):
    """A SwiGLU MLP: gate and up read x, down reads their product."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, 96, bias=bias)
        self.up = torch.nn.Linear(HIDDEN, 96, bias=bias)
        self.down = torch.nn.Linear(96, HIDDEN, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SharedInputWeightFromInput(torch.nn.Module):
    """One linear's weight is a graph input: only the two constant ones may fuse."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(HIDDEN, 32, bias=False)
        self.b = torch.nn.Linear(HIDDEN, 16, bias=False)

    def forward(self, x, w):
        return self.a(x), self.b(x), F.linear(x, w)


def ir_of(lowered):
    payload, data = delegate_payload(lowered.edge)
    return N.deserialize(payload), data


def lowered(module, inputs, disable=()):
    """Lower (one delegate segment, nothing outside), check against eager; (IR program, named data)."""
    module = module.eval()
    result = lower(module, inputs, partitioner=MLXPartitioner(disable=disable))
    assert result.summary == (1, []), result.summary
    dtype = inputs[0].dtype
    with torch.no_grad():
        expected = module(*inputs)
    assert_close(result.method().execute(list(inputs)), expected, *TOLERANCE[dtype])
    return ir_of(result)


def kinds(program) -> Counter:
    return Counter(type(i.node).__name__ for i in program.instructions)


def inputs_of(dtype, rank):
    shape = (2, 5, HIDDEN) if rank == 3 else (5, HIDDEN)
    return (torch.randn(shape, dtype=dtype),)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("bias", ["none", "all", "mixed"])
def test_qkv_fuse_into_one_product(bias, rank, dtype):
    torch.manual_seed(0)
    program, data = lowered(Qkv(bias).to(dtype), inputs_of(dtype, rank))
    k = kinds(program)
    assert k["LinearNode"] == 1 and k["SliceNode"] == 3, k
    (linear,) = [i.node for i in program.instructions if isinstance(i.node, N.LinearNode)]
    assert (linear.bias is not None) == (bias != "none")
    slices = [(s.node.start.literal, s.node.stop.literal) for s in program.instructions
              if isinstance(s.node, N.SliceNode)]
    assert slices == [(0, 64), (64, 80), (80, 96)]
    # The stacked weight (and bias) is stored, its parts are not (the scalar is `* 2`'s).
    stored = [c for c in program.constants if c.shape]
    assert sorted(tuple(c.shape) for c in stored) == sorted([(96, HIDDEN)] + ([(96,)] if bias != "none" else []))
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert sum(len(data[c.key]) for c in stored) == itemsize * (96 * HIDDEN + (96 if bias != "none" else 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_fuse_and_down_stays(bias, dtype):
    torch.manual_seed(0)
    program, _ = lowered(GateUp(bias).to(dtype), inputs_of(dtype, 3))
    k = kinds(program)
    assert k["LinearNode"] == 2 and k["SliceNode"] == 2, k


def test_mixed_bias_adds_zeros_for_the_linear_without_one():
    torch.manual_seed(0)
    module = Qkv("mixed")
    program, data = lowered(module, inputs_of(torch.float32, 2))
    bias_key = next(c.key for c in program.constants if list(c.shape) == [96])
    stored = torch.frombuffer(bytearray(data[bias_key]), dtype=torch.float32)
    assert torch.equal(stored, torch.cat([torch.zeros(64), module.k.bias.detach(), torch.zeros(16)]))


def test_weight_from_an_input_stays_unfused():
    torch.manual_seed(0)
    inputs = (torch.randn(3, HIDDEN), torch.randn(8, HIDDEN))
    program, _ = lowered(SharedInputWeightFromInput(), inputs)
    k = kinds(program)
    assert k["LinearNode"] == 2 and k["SliceNode"] == 2, k  # a+b fused, the input-weight linear alone


def test_shared_weight_stays_unfused_and_stored_once():
    """A weight another node also reads would be stored twice if stacked: it is left alone."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(HIDDEN, 32, bias=False)
            self.b = torch.nn.Linear(HIDDEN, 32, bias=False)

        def forward(self, x, y):
            return self.a(x), self.b(x), self.a(y)

    torch.manual_seed(0)
    program, _ = lowered(Tied(), (torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)))
    assert kinds(program)["LinearNode"] == 3
    assert "SliceNode" not in kinds(program)


def test_disable_switch_restores_one_product_per_linear():
    torch.manual_seed(0)
    module, inputs = Qkv("mixed"), inputs_of(torch.float32, 3)
    for disable in ({"fuse_linears"}, {"fusions"}):
        program, _ = lowered(module, inputs, disable=disable)
        k = kinds(program)
        assert k["LinearNode"] == 3 and "SliceNode" not in k, (disable, k)
        assert len([c for c in program.constants if c.shape]) == 4


def test_same_groups_in_two_methods_share_the_stacked_weight():
    """The stacked weight's key comes from its parts' keys: two lowerings of the
    same weights give the same key (the store keeps one copy), other weights another."""
    torch.manual_seed(0)
    module, inputs = Qkv(), inputs_of(torch.float32, 2)
    first, _ = lowered(module, inputs)
    again, _ = lowered(module, (torch.randn(7, HIDDEN),))
    assert [c.key for c in first.constants] == [c.key for c in again.constants]
    other, _ = lowered(Qkv(), inputs)
    assert [c.key for c in other.constants] != [c.key for c in first.constants]
