"""`fuse_quantized_glu`, `fuse_quantized_residual` and `fuse_quantized_norm` (patterns/quantized_epilogue.py):
a SwiGLU MLP's grouped gate / up with `silu(g) * u`, residual adds after quantized products and the
RMSNorms before them become one QuantizedLinearNode each; on the CPU the GEMV applies them (cpp/kernels/qgemv_cpu.cpp, its epilogue),
elsewhere MLX ops follow the product. Every path of `lower_and_compare` (node by node, compiled, CPU
kernels off) against eager on the same packed weights, at 1 and 3 rows (the GEMV) and 30 (the
prefill kernel, where the epilogue is composed)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.ir import nodes as N
from mlx_delegate.models.llama import RMSNorm
from mlx_delegate.partitioner import MLXPartitioner
from mlx_delegate.testing import QUANTIZED_TOLERANCE, cases, cpu_kernels_active, lower_and_compare


def packed(n: int, k: int, bits: int, group_size: int, gen: torch.Generator,
           scales_dtype: torch.dtype) -> Q.MLXQuantized:
    scales = (torch.rand(n, k // group_size, generator=gen) + 0.5) * 0.16 / 2**bits
    biases = -(2 ** (bits - 1) + torch.randn(n, k // group_size, generator=gen)) * scales
    return Q.MLXQuantized(Q.pack_words(torch.randint(0, 2**bits, (n, k), generator=gen), bits),
                          scales.to(scales_dtype), biases.to(scales_dtype), group_size, bits)


class Block(torch.nn.Module):
    """A Llama-like block's products: h = x + o(norm1(x)); h + down(silu(gate(g)) * up(g)), g = norm2(h).
    Hidden 52: the GLU's vector loop has a tail."""

    def __init__(self, k: int = 96, hidden: int = 52, bits: int = 4, group_size: int = 32,
                 scales_dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.o = Q.QuantizedLinear(packed(k, k, bits, group_size, gen, scales_dtype))
        self.gate = Q.QuantizedLinear(packed(hidden, k, bits, group_size, gen, scales_dtype))
        self.up = Q.QuantizedLinear(packed(hidden, k, bits, group_size, gen, scales_dtype))
        self.down = Q.QuantizedLinear(packed(k, hidden + 12, bits, group_size, gen, scales_dtype))
        self.norm1, self.norm2 = RMSNorm(k, 1e-5), RMSNorm(k, 1e-6)
        with torch.no_grad():
            self.norm1.weight.uniform_(0.5, 1.5, generator=gen)
            self.norm2.weight.uniform_(0.5, 1.5, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o(self.norm1(x))
        g = self.norm2(h)
        a = F.silu(self.gate(g)) * self.up(g)
        return self.down(F.pad(a, (0, 12))) + h  # K of down a multiple of the group size


def inputs() -> tuple:
    return (torch.randn(1, 3, 96),)


def more() -> list[tuple]:
    return [(torch.randn(1, 1, 96),), (torch.randn(1, 30, 96),)]


DYNAMIC = ({1: Dim("L", min=1, max=32)},)
CASES = cases("block", Block, inputs, (torch.float32, torch.bfloat16, torch.float16), is_module=True,
              tolerance=QUANTIZED_TOLERANCE, more_inputs=more, dynamic_shapes=DYNAMIC, compiled_exact=False)


def ir_nodes(lowered) -> Counter:
    gm, counts = lowered.edge.exported_program().graph_module, Counter()
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target.startswith("lowered_module"):
            program = N.deserialize(getattr(gm, n.target).processed_bytes)
            counts.update(type(i.node).__name__ for i in program.instructions)
            counts.update(f"{type(i.node).__name__}.glu" for i in program.instructions if getattr(i.node, "glu", 0))
            for field in ("residual", "norm_weight"):
                counts.update(f"{type(i.node).__name__}.{field}" for i in program.instructions
                              if getattr(i.node, field, None) is not None)
    return counts


@pytest.mark.parametrize("case", CASES, ids=str)
def test_glu_and_residuals_fuse(case):
    calls = _runtime.cpu_kernel_calls()
    lowered = lower_and_compare(case)
    nodes = ir_nodes(lowered)
    # norm + o + residual, norm + gate / up + GLU, down + residual: three products and nothing around them.
    assert nodes["QuantizedLinearNode"] == 3 and nodes["QuantizedLinearNode.glu"] == 1
    assert nodes["QuantizedLinearNode.residual"] == 2 and nodes["QuantizedLinearNode.norm_weight"] == 2
    assert not {"UnaryNode", "BinaryNode", "SliceNode", "RmsNormNode"} & set(nodes), nodes
    if cpu_kernels_active():
        assert _runtime.cpu_kernel_calls() > calls


def test_fusions_off_keep_the_graph():
    """Switched off, the same block lowers as before: a grouped product sliced, SiLU, multiply, adds."""
    case = CASES[0]
    partitioner = MLXPartitioner(disable={"fuse_quantized_glu", "fuse_quantized_residual", "fuse_quantized_norm"})
    nodes = ir_nodes(lower_and_compare(case, partitioner=partitioner))
    assert nodes["QuantizedLinearNode"] == 3 and not nodes["QuantizedLinearNode.glu"]
    assert not nodes["QuantizedLinearNode.residual"] and not nodes["QuantizedLinearNode.norm_weight"]
    assert nodes["SliceNode"] == 2 and nodes["BinaryNode"] >= 3 and nodes["RmsNormNode"] == 2
