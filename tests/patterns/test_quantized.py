"""Weight-only quantization (torchao int8 / int4): quantized linears and
embeddings lower to MLX's quantized kernels, match the same quantized model in
eager torch, and layouts MLX cannot take still run (unfused) in the delegate."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from torch.export import Dim
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, MappingType, quantize_
from torchao.quantization.granularity import PerAxis, PerGroup
from transformers import LlamaConfig

from mlx_delegate import MLXPartitioner
from mlx_delegate import quantization as Q
from mlx_delegate.ir import nodes as N
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.models import loading
from mlx_delegate.patterns import MLXPatternPass
from mlx_delegate.testing import QUANTIZED_TOLERANCE, assert_close, delegate_summary, eager_greedy

FUSED = {"QuantizedLinearNode", "QuantizedEmbeddingNode"}
PLAIN = {"LinearNode", "MatmulNode", "AddmmNode", "TakeNode"}


class LinearsAndEmbedding(torch.nn.Module):
    def __init__(self, k: int = 256) -> None:
        super().__init__()
        self.biased = torch.nn.Linear(k, 48)
        self.plain = torch.nn.Linear(k, 40, bias=False)
        self.emb = torch.nn.Embedding(24, k)

    def forward(self, x, tokens):
        return self.biased(x), self.plain(x), self.emb(tokens)


# (mode, group size, torchao mapping): every layout the fused kernels take, in one program per dtype.
LAYOUTS = [("int8", None, "symmetric"), ("int8", 32, "symmetric"), ("int8", 128, "symmetric"),
           ("int4", 32, "symmetric"), ("int4", 64, "symmetric"), ("int4", 128, "symmetric"),
           ("int4", 32, "asymmetric")]


class AllLayouts(torch.nn.Module):
    """One LinearsAndEmbedding per layout, quantized as that row says."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(LinearsAndEmbedding() for _ in LAYOUTS)
        self.to(dtype).eval()
        for block, (mode, group_size, mapping) in zip(self.blocks, LAYOUTS):
            config = replace(Q.torchao_config(mode, group_size), mapping_type=MappingType[mapping.upper()])
            quantize_(block, config, filter_fn=lambda m, _: isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))

    def forward(self, x, tokens):
        return [y for block in self.blocks for y in block(x, tokens)]


def ir_nodes(edge) -> Counter:
    """Node types in every delegate payload of the lowered program."""
    gm, counts = edge.exported_program().graph_module, Counter()
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target.startswith("lowered_module"):
            program = N.deserialize(getattr(gm, n.target).processed_bytes)
            counts.update(type(i.node).__name__ for i in program.instructions)
    return counts


def lower_quantized(module, inputs, dtype, more_inputs=(), standard=False):
    """Lower with the pattern pass (token count dynamic), or with `standard` as ExecuTorch's docs show
    (`to_edge_transform_and_lower` with only the partitioner: the delegate's preprocess fuses), check
    every input set against eager; returns (pattern count, delegate summary, IR node counts)."""
    pattern_pass = MLXPatternPass()
    dynamic = ({1: Dim("L", min=1, max=16)}, {1: Dim("T", min=1, max=16)})
    ep = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=True)
    if standard:
        edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()])
    else:
        edge = llm_export.lower(ep, pattern_pass=pattern_pass)
    buffer = edge.to_executorch().buffer  # the program reads from it: keep it alive
    method = Runtime.get().load_program(buffer).load_method("forward")
    for args in (inputs, *more_inputs):
        with torch.no_grad():
            assert_close(method.execute(list(args)), module(*args), *QUANTIZED_TOLERANCE[dtype])
    return pattern_pass.counts.get("quantized", 0), delegate_summary(edge), ir_nodes(edge)


def sample(dtype, k=256, length=3):
    return torch.randn(2, length, k, dtype=dtype), torch.randint(0, 24, (2, length))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_layers_fuse(dtype):
    """int8 (per channel, groups of 32 and 128) and int4 (groups of 32/64/128, symmetric and not):
    linears with and without bias and an embedding each become quantized nodes; the two linears
    reading x (one with a bias, one without) share one product over their stacked weights."""
    module = AllLayouts(dtype)
    assert (module.blocks[-1].biased.weight.zero_point != 0).any()  # the asymmetric row has zero points
    # 6 rows and 16 rows: one and two row blocks of the CPU kernel (with AVX2; without, at 8 rows the
    # runtime switches from quantized_matmul to dequantize + matmul).
    fused, summary, nodes = lower_quantized(module, sample(dtype), dtype, [sample(dtype, length=8)])
    assert fused == 3 * len(LAYOUTS) and summary == (1, [])
    # One grouped product per MLX layout reading x: int8 per channel (K = 256) is int8 in groups of 128
    # like row 3, and the two int4 group-32 rows share theirs too.
    layouts = len({("int8", 128) if mode == "int8" and g is None else (mode, g) for mode, g, _ in LAYOUTS})
    assert nodes["QuantizedLinearNode"] == layouts == 5 and nodes["SliceNode"] == 2 * len(LAYOUTS)
    assert nodes["QuantizedEmbeddingNode"] == len(LAYOUTS)
    assert not PLAIN & set(nodes) and not {"BinaryNode", "AsTypeNode"} & set(nodes)  # no dequantize + matmul


def test_standard_lowering_fuses_in_preprocess():
    """torchao's linears and embeddings lowered the standard way, with no pattern pass, run as the same
    quantized nodes (fused in the delegate's preprocess), not a dequantize per call into a float product."""
    module = AllLayouts(torch.float32)
    _, summary, nodes = lower_quantized(module, sample(torch.float32), torch.float32,
                                        [sample(torch.float32, length=16)], standard=True)
    assert summary == (1, [])
    assert nodes["QuantizedLinearNode"] == 5 and nodes["QuantizedEmbeddingNode"] == len(LAYOUTS)
    assert not PLAIN & set(nodes) and not {"BinaryNode", "AsTypeNode"} & set(nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weights", ["int4-g32", "int8-channel"])
def test_dynamic_activation_quantization_lowers_whole(weights, dtype):
    """torchao's 8da4w / 8da8w (Int8DynamicActivationIntxWeightConfig, ExecuTorch's documented LLM
    configs) quantize each linear's input per token on every call: choose_qparams_affine,
    quantize_affine and dequantize_affine, ops ExecuTorch's runtime has no kernels for (to_executorch
    refused the program while they stayed outside the delegate). Lowered the standard way, the whole
    program is delegated, the weights are fused quantized products, and every token count matches eager."""
    granularity = PerGroup(32) if weights == "int4-g32" else PerAxis(0)
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=getattr(torch, weights.split("-")[0]),
                                                   weight_granularity=granularity)
    module = LinearsAndEmbedding().to(dtype).eval()
    quantize_(module, config, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
    _, summary, nodes = lower_quantized(module, sample(dtype), dtype, [sample(dtype, length=1),
                                                                       sample(dtype, length=16)], standard=True)
    assert summary == (1, [])
    assert nodes["QuantizedLinearNode"] >= 1 and not PLAIN - {"TakeNode"} & set(nodes)


class MergedHeads(torch.nn.Module):
    """A quantized linear reading heads merged by a reshape (attention's output projection), of a
    transposed array and of a contiguous one: the product reads the reshape's source in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 40, bias=False)

    def forward(self, x, tokens):
        B, L = x.shape[:2]
        heads = x.view(B, L, 4, 64) * 2  # a contiguous [B, L, 4, 64]
        transposed = (heads.transpose(1, 2) + 1).transpose(1, 2)  # [B, L, 4, 64] through a transpose
        return self.proj(heads.reshape(B, L, 256)), self.proj(transposed.reshape(B, L, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reshaped_input_read_in_place(dtype):
    from mlx_delegate import _runtime

    module = MergedHeads().to(dtype).eval()
    quantize_(module, Q.torchao_config("int4", 32), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
    before = _runtime.cpu_kernel_call_counts().get("qgemv_reshaped_input", 0)
    fused, _, nodes = lower_quantized(module, sample(dtype), dtype, [sample(dtype, length=1)])
    assert fused == 2 and nodes["QuantizedLinearNode"] == 2
    if _runtime.cpu_kernels_enabled():
        assert _runtime.cpu_kernel_call_counts().get("qgemv_reshaped_input", 0) >= before + 4


def test_unsupported_group_size_runs_unfused():
    """Groups of 16 are not an MLX layout: the dequantize runs as element-wise ops, the product as a linear."""
    module = LinearsAndEmbedding(k=48).eval()
    quantize_(module, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)),
              filter_fn=lambda m, _: isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
    fused, summary, nodes = lower_quantized(module, sample(torch.float32, k=48), torch.float32)
    assert fused == 0 and summary == (1, [])
    assert not FUSED & set(nodes) and nodes["LinearNode"] == 2 and nodes["TakeNode"] == 1


def test_repacking_is_exact():
    """MLX's w = scale * u + bias reproduces torchao's (q - zp) * scale, including the per-channel split."""
    q = torch.randint(-8, 8, (6, 256), dtype=torch.int8)
    scale, zp = torch.rand(6, 1) + 0.1, torch.randint(-3, 3, (6, 1), dtype=torch.int8)
    packed = Q.to_mlx(q, scale, zp, 256, -8, 7, torch.float32)
    assert (packed.group_size, packed.bits, tuple(packed.w.shape)) == (128, 4, (6, 32))
    expected = (q.float() - zp.float()) * scale
    torch.testing.assert_close(Q.dequantize_mlx(packed.w, packed.scales, packed.biases, 128, 4), expected)
    assert Q.to_mlx(q, scale, zp, 256, -8, 8, torch.float32).bits == 8  # 17 levels need a wider field
    assert Q.to_mlx(q.reshape(12, 128), scale.repeat(2, 1), None, 128, -8, 7, torch.float32) is not None
    assert Q.to_mlx(q[:, :48], scale, zp, 48, -8, 7, torch.float32) is None  # 48 is no MLX group


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="int3"):
        Q.quantize_model(torch.nn.Linear(64, 8), "int3")
    with pytest.raises(ValueError, match="group size 48"):
        Q.quantize_model(torch.nn.Linear(96, 8), "int4", 48)


def test_int4_llama_generates_like_eager():
    """A tiny random Llama with tied embeddings, int4 group 32: greedy tokens equal eager torch's."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = loading.from_config(config, max_seq_len=64, seed=0).model
    edge = llm_export.lower(llm_export.export_model(llm_export.quantize_weights(model, "int4", 32)),
                            constant_methods=llm_export.metadata(model))
    nodes = ir_nodes(edge)
    assert delegate_summary(edge) == (1, [])
    # Per layer q/k/v, o, gate/up and down (q/k/v and gate/up each one grouped product), + the tied lm_head.
    assert nodes["QuantizedLinearNode"] == 2 * 4 + 1 and nodes["QuantizedEmbeddingNode"] == 1
    prompt, steps = [5, 17, 99, 3, 42, 7], 16
    ours = list(Generator(edge.to_executorch().buffer, eos_token_ids=[]).generate_ids(prompt, steps))
    assert ours == eager_greedy(model, prompt, steps)


def test_generate_cli_quantize_options():
    from mlx_delegate.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--quantize", "int4", "--group-size", "32"])
    assert (args.quantize, args.group_size) == ("int4", 32)
    assert build_parser().parse_args(["generate", "hi"]).quantize is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--quantize", "int4", "--group-size", "48"])
