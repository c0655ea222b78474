"""Mixtral and Qwen3-MoE through the Llama-family model (`models.moe`): a tiny random checkpoint
saved by `transformers` loads through `from_hf_dir`, matches HF eager, lowers to one delegate
segment (routing, grouped expert products and the on-device sampler included) and generates HF's
greedy tokens."""

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig

from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.pipelines.llm.sampling import Sampler
from mlx_delegate.models import loading
from mlx_delegate.models.moe import SparseMoeBlock, fuse_expert_weights
from mlx_delegate.testing import delegate_summary, hf_greedy

MAX_SEQ_LEN = 48
PROMPT = [5, 17, 99, 3, 42, 7]
NEW_TOKENS = 24
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=MAX_SEQ_LEN)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    # Layer 1 dense (mlp_only_layers); unnormalised routing weights (Qwen3-MoE's default).
    "qwen3_moe": lambda: Qwen3MoeConfig(**TINY, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                        mlp_only_layers=[1], norm_topk_prob=False),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe(request, tmp_path_factory):
    """(HF eager model, our model loaded from its saved checkpoint, .pte bytes sampling on device)."""
    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    hf = loading.hf_class(config)(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "load_tokenizer", lambda path: None)  # weights only: no tokenizer saved
        model = loading.from_hf_dir(path, max_seq_len=MAX_SEQ_LEN).model
    edge = llm_export.lower(llm_export.export_model(model, sampler="sample"),
                            constant_methods=llm_export.metadata(model))
    assert delegate_summary(edge) == (1, [])
    return hf, model, edge.to_executorch().buffer


def test_checkpoint_loads_and_matches_hf_eager(moe):
    hf, model, _ = moe
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    expected = ["SparseMoeBlock", "MLP"] if model.args.dense_layers else ["SparseMoeBlock"] * 2
    assert kinds == expected
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        ours = model(tokens, torch.tensor([0]))
        model.reset_cache()
        torch.testing.assert_close(ours, hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_hf(moe, runtime_path):
    hf, _, pte = moe
    gen = Generator(pte, eos_token_ids=[])
    assert gen.samples_on_device
    assert list(gen.generate_ids(PROMPT, NEW_TOKENS)) == hf_greedy(hf, PROMPT, NEW_TOKENS)


def test_sampled_generation_is_seeded(moe):
    _, _, pte = moe
    gen = Generator(pte, eos_token_ids=[])
    first = list(gen.generate_ids(PROMPT, 12, Sampler(temperature=1.0, top_k=20, top_p=0.9, seed=1)))
    gen.reset()
    assert list(gen.generate_ids(PROMPT, 12, Sampler(temperature=1.0, top_k=20, top_p=0.9, seed=1))) == first


def test_routing_matches_a_per_token_loop():
    """The sorted, grouped form equals routing each token through its k experts one by one."""
    torch.manual_seed(0)
    block = SparseMoeBlock(hidden=16, intermediate=8, num_experts=5, top_k=3, normalise=False)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(7, 16)
    probs = torch.softmax(x @ block.gate.weight.T, -1)
    expected = torch.zeros_like(x)
    for t in range(len(x)):
        weights, experts = probs[t].topk(3)
        for w, e in zip(weights, experts):
            gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += w * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(block(x[None])[0], expected, rtol=1e-5, atol=1e-5)


def test_incomplete_expert_weights_are_refused():
    w = torch.zeros(4, 4)
    sd = {"model.layers.0.mlp.experts.0.gate_proj.weight": w, "model.layers.0.mlp.experts.0.down_proj.weight": w}
    with pytest.raises(ValueError, match="incomplete expert weights"):
        fuse_expert_weights(sd)
