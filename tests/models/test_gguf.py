"""GGUF weights kept in the file's own quantization (`models.gguf`): the repacked blocks
dequantize (in MLX) to exactly what gguf's dequantizer gives, and a tiny GGUF Llama run
on them by the delegate matches HF eager on the dequantized weights."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import LlamaConfig, LlamaForCausalLM

from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.models import gguf as G
from mlx_delegate.models import loading
from mlx_delegate.quantization import QuantizedEmbedding, QuantizedLinear, dequantize_mlx, install_packed
from mlx_delegate.testing import assert_steps_match_hf, delegate_summary, hf_greedy

ROWS, COLS = 6, 512


def raw_blocks(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """[ROWS, bytes] blocks: gguf's own quantizer where it has one, else random bytes with sane fp16 d / dmin."""
    if qtype != QT.Q4_K:
        return gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, (ROWS, COLS // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = rng.uniform(1e-3, 1e-1, (ROWS, COLS // 256, 2)).astype("<f2").view(np.uint8)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K], ids=lambda t: t.name)
def test_repacked_blocks_dequantize_exactly(qtype):
    raw = raw_blocks(qtype, np.random.default_rng(qtype.value))
    packed = G.repack(raw, qtype.name, (ROWS, COLS))
    assert packed.group_size == 32 and packed.bits == (8 if qtype == QT.Q8_0 else 4)
    # fp16 d / m (and -8 d, -128 d) are stored as they are; Q4_K's d * sc_j needs float32 here.
    assert packed.scales.dtype == packed.biases.dtype == (torch.float32 if qtype == QT.Q4_K else torch.float16)
    # MLX computes in the scales' dtype: the runtime widens narrow ones first (cpp/ops/quantized.cpp).
    ours = mx.dequantize(mx.array(packed.w.numpy().view(np.uint32)), mx.array(packed.scales.float().numpy()),
                         mx.array(packed.biases.float().numpy()), group_size=packed.group_size, bits=packed.bits)
    expected = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(np.array(ours), expected)  # bit for bit, in float32
    reference = dequantize_mlx(packed.w, packed.scales, packed.biases, 32, packed.bits, dtype=torch.float32)
    assert np.array_equal(reference.numpy(), expected)
    with pytest.raises(ValueError, match="does not hold"):
        G.repack(raw, qtype.name, (ROWS, COLS * 2))


def test_install_packed_refuses_a_shape_mismatch():
    packed = G.repack(raw_blocks(QT.Q4_0, np.random.default_rng(0)), "Q4_0", (ROWS, COLS))
    model = torch.nn.Sequential(torch.nn.Linear(COLS, ROWS + 1))
    with pytest.raises(ValueError, match="0.weight"):
        install_packed(model, {"0.weight": packed})


# llama.cpp's type per tensor in the tiny file; ffn_down stays F16 (dequantized when read).
TYPES = {"token_embd": QT.Q8_0, "attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q8_0,
         "attn_output": QT.Q4_1, "ffn_gate": QT.Q4_0, "ffn_up": QT.Q8_0, "ffn_down": QT.F16}
MAX_SEQ_LEN = 48
PROMPT = [5, 17, 99, 3, 42, 7]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script's Q/K row order (what the reader undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama(path, config: LlamaConfig) -> None:
    torch.manual_seed(0)
    state = LlamaForCausalLM(config).state_dict()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(MAX_SEQ_LEN)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight":  # tied: llama.cpp stores only token_embd
            continue
        name = names.get_name(hf_name.rpartition(".")[0]) + ".weight"
        data = t.float().numpy()
        if ".attn_q." in name or ".attn_k." in name:
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        qtype = next((q for key, q in TYPES.items() if f"{key}." in name), QT.F32)
        if qtype == QT.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif qtype == QT.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=MAX_SEQ_LEN,
                         tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(path, config)
    return path


@pytest.fixture(scope="module")
def tiny_program(tiny_gguf):
    """(HF config, HF eager model on the dequantized weights, the delegate's .pte bytes), lowered once."""
    # The reference: transformers' own GGUF reader (dequantizes; undoes the Q/K permutation).
    config, reference = loading.read_gguf(tiny_gguf)
    _, floats, packed = G.read(tiny_gguf)
    assert set(packed) == {k for k in reference if "down_proj" not in k and "norm" not in k}
    for name, q in packed.items():
        assert q.scales.dtype == torch.float16, name  # Q4_0 / Q4_1 / Q8_0: exact in fp16
        assert torch.equal(dequantize_mlx(q.w, q.scales, q.biases, q.group_size, q.bits, dtype=torch.float32),
                           reference[name]), name
    assert all(torch.equal(t, reference[k]) for k, t in floats.items())

    model = loading.model_from_gguf(tiny_gguf, max_seq_len=MAX_SEQ_LEN).eval()
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 6 * config.num_hidden_layers
    model.to_dtype(torch.float32)  # what loading does: the packed scales stay fp16
    assert all(m.scales.dtype == torch.float16 for m in model.modules() if isinstance(m, QuantizedLinear))
    edge = llm_export.lower(llm_export.export_model(model), constant_methods=llm_export.metadata(model))
    assert delegate_summary(edge) == (1, [])
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(reference, strict=False)  # lm_head is tied to the embedding
    return config, hf, edge.to_executorch().buffer


def test_tiny_gguf_llama_matches_eager_on_the_dequantized_weights(tiny_program, runtime_path):
    _, hf, buffer = tiny_program
    gen = Generator(buffer, eos_token_ids=[])
    assert_steps_match_hf(gen, hf, PROMPT, 4)
    gen.reset()
    assert list(gen.generate_ids(PROMPT, 12)) == hf_greedy(hf, PROMPT, 12)
