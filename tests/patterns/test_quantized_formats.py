"""The export-friendly torchao weight formats ExecuTorch ships (`executorch.extension.llm.export`):
int4 in torchao's `Int4Tensor` layout (`dequantize_int4_tensor`), NVFP4 (`dequantize_nvfp4`) and
MXFP8 (`dequantize_mx`). Linears and embeddings lower to MLX's quantized ops (affine repack, MLX's
nvfp4 / mxfp8 modes), a dequantize read by another op to `mlx_delegate::dequantize`, and every
result matches the quantized model run eagerly."""

import pytest
import torch
from executorch.extension.llm.export import ExportableInt4Tensor
from executorch.extension.llm.export.mx import ExportableMXConfig
from executorch.extension.llm.export.nvfp4 import ExportableNVFP4Config
from torch.export import Dim
from torchao.quantization import IntxWeightOnlyConfig, MappingType, quantize_
from torchao.quantization.granularity import PerGroup
from transformers import LlamaConfig

from mlx_delegate import quantization as Q
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.models import loading
from mlx_delegate.testing import QUANTIZED_TOLERANCE, OpCase, delegate_summary, eager_greedy, lower_and_compare

from .test_quantized import ir_nodes


def _layers(m: torch.nn.Module) -> bool:
    return isinstance(m, (torch.nn.Linear, torch.nn.Embedding))


def int4_tensor(module: torch.nn.Module, group_size: int = 32, mapping: str = "asymmetric") -> None:
    """torchao's int4 in the Int4Tensor layout. torchao's own Int4WeightOnlyConfig needs the CUDA-only
    mslk package to quantize, so quantize with IntxWeightOnlyConfig and repack as ExecuTorch does."""
    quantize_(module, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size),
                                           mapping_type=MappingType[mapping.upper()]), filter_fn=lambda m, _: _layers(m))
    for m in module.modules():
        if _layers(m):
            m.weight = torch.nn.Parameter(ExportableInt4Tensor.from_intx_unpacked_to_int8_tensor(m.weight),
                                          requires_grad=False)


FORMATS = {
    "int4": int4_tensor,
    "nvfp4": lambda m: quantize_(m, ExportableNVFP4Config(), filter_fn=lambda m, _: _layers(m)),
    "nvfp4-no-tensor-scale": lambda m: quantize_(m, ExportableNVFP4Config(use_per_tensor_scale=False),
                                                 filter_fn=lambda m, _: _layers(m)),
    "mxfp8": lambda m: quantize_(m, ExportableMXConfig(), filter_fn=lambda m, _: _layers(m)),
}


class Layers(torch.nn.Module):
    """Linears with and without bias (48 and, where the format allows, an odd 37 outputs: NVFP4 needs
    multiples of 16), an embedding, and a dequantize read by another op (outside the linear / embedding
    pattern)."""

    def __init__(self, k: int = 64, odd: bool = True) -> None:
        super().__init__()
        self.biased = torch.nn.Linear(k, 48)
        self.plain = torch.nn.Linear(k, 37 if odd else 80, bias=False)
        self.emb = torch.nn.Embedding(32, k)
        self.tail = torch.nn.Linear(k, 16, bias=False)

    def forward(self, x, tokens):
        return self.biased(x), self.plain(x), self.emb(tokens), self.tail(x), self.tail.weight.dequantize().sum(0)


def sample(dtype, length=3, k=64):
    return torch.randn(2, length, k, dtype=dtype), torch.randint(0, 32, (2, length))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_lowers_and_matches_eager(fmt, dtype):
    """Through the harness: the plain partitioner repacks these formats itself; node by node, compiled and
    with the CPU kernels off, at 3 and 9 rows (MLX's quantized matmul, and on the CPU dequantize + matmul
    from 8 rows), token count dynamic."""
    def module() -> torch.nn.Module:
        torch.manual_seed(0)
        m = Layers(odd=not fmt.startswith("nvfp4")).to(dtype).eval()
        FORMATS[fmt](m)
        return m

    case = OpCase(f"{fmt}-{dtype}", module, lambda: sample(dtype), dtype=dtype,
                  dynamic_shapes=({1: Dim("L", min=1, max=16)}, {1: Dim("T", min=1, max=16)}),
                  more_inputs=lambda: [sample(dtype, length=9)],
                  rtol=QUANTIZED_TOLERANCE[dtype][0], atol=QUANTIZED_TOLERANCE[dtype][1],
                  # no float32 twin: .float() on these modules does not re-stamp the quantized weights
                  fp32_reference=False)
    nodes = ir_nodes(lower_and_compare(case).edge)
    assert not {"LinearNode", "MatmulNode", "AddmmNode"} & set(nodes)
    if fmt == "int4":  # affine: biased + plain are one grouped product (tail's packed weight is shared with
        # the dequantize, so it stays apart), the embedding its own node
        assert nodes["QuantizedLinearNode"] == 2 and nodes["QuantizedEmbeddingNode"] == 1
        assert nodes["DequantizeNode"] == 1  # tail's weight for the sum
    else:  # the embedding is gathered rows + DequantizeNode
        assert nodes["QuantizedLinearNode"] == 3 and nodes["DequantizeNode"] == 2


def test_repacks_are_exact():
    """Each repack reproduces the source format's own dequantize in fp32: int4 to fp32 rounding (it is
    affine's scale * q + bias there, torchao's (q - zero_point) * scale), the microscaled modes bit for bit
    (NVFP4's per-tensor scale multiplies after the block scale, not into it: one rounding apart)."""
    torch.manual_seed(0)
    for fmt, quantize in FORMATS.items():
        linear = torch.nn.Linear(64, 32).eval()
        quantize(linear)
        w = linear.weight
        expected = w.dequantize(torch.float32)
        if fmt == "int4":
            packed = Q.int4_tensor_to_mlx(w.qdata, w.scale, w.zero_point, w.group_size, torch.float32)
        elif fmt.startswith("nvfp4"):
            packed = Q.nvfp4_to_mlx(w.qdata, w.scale, w.per_tensor_scale, w.block_size)
        else:
            packed = Q.mx_to_mlx(w.qdata, w.scale, w.elem_dtype, w.block_size)
        got = Q.dequantize_mlx(packed.w, packed.scales, packed.biases, packed.group_size, packed.bits,
                               packed.mode, torch.float32) * packed.global_scale
        rtol, atol = {"int4": (0, 1e-6), "nvfp4": (2.4e-7, 0)}.get(fmt, (0, 0))
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def test_unsupported_layouts_are_refused():
    """MLX has no e5m2 elements and no affine groups of 16: the repack says so (None), never a wrong layout,
    and lowering stops with an error naming the op and the layouts MLX takes."""
    linear = torch.nn.Linear(64, 32).eval()
    quantize_(linear, ExportableMXConfig(elem_dtype=torch.float8_e5m2))
    w = linear.weight
    assert Q.mx_to_mlx(w.qdata, w.scale, w.elem_dtype, w.block_size) is None
    ep = torch.export.export(linear, (torch.randn(2, 64),), strict=True)
    with pytest.raises(ValueError, match=r"dequantize_mx.*no e5m2"):
        llm_export.lower(ep)
    linear = torch.nn.Linear(64, 32).eval()
    int4_tensor(linear, group_size=16)
    w = linear.weight
    assert Q.int4_tensor_to_mlx(w.qdata, w.scale, w.zero_point, w.group_size, torch.float32) is None


def test_int4_tensor_llama_lowers_whole_and_generates_like_eager():
    """A tiny random Llama with every linear and the embedding in the Int4Tensor layout: one segment,
    quantized nodes only, greedy tokens equal eager torch's."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = loading.from_config(config, max_seq_len=64, seed=0).model
    int4_tensor(model, group_size=32)
    edge = llm_export.lower(llm_export.export_model(model), constant_methods=llm_export.metadata(model))
    nodes = ir_nodes(edge)
    assert delegate_summary(edge) == (1, [])
    assert nodes["QuantizedLinearNode"] == 2 * 4 + 1 and nodes["QuantizedEmbeddingNode"] == 1
    prompt, steps = [5, 17, 99, 3, 42, 7], 12
    ours = list(Generator(edge.to_executorch().buffer, eos_token_ids=[]).generate_ids(prompt, steps))
    assert ours == eager_greedy(model, prompt, steps)
