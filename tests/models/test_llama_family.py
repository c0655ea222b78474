"""Mistral, Qwen2 and Qwen3 through the Llama-family model: one delegate segment, greedy
generation and per-step logits equal to HF eager on tiny random configs."""

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.models import loading
from mlx_delegate.testing import assert_steps_match_hf, delegate_summary, hf_greedy, hf_next_logits

MAX_SEQ_LEN = 64
PROMPT = [5, 17, 99, 3, 42, 7]
NEW_TOKENS = 32
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=MAX_SEQ_LEN)
CONFIGS = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request):
    """(HF eager model, .pte bytes) with the same random weights."""
    config = CONFIGS[request.param](**TINY)
    loaded = loading.from_config(config, max_seq_len=MAX_SEQ_LEN, seed=0)
    torch.manual_seed(0)
    hf = loading.hf_class(config)(config).eval()
    edge = llm_export.lower(llm_export.export_model(loaded.model),
                            constant_methods=llm_export.metadata(loaded.model))
    assert delegate_summary(edge) == (1, [])
    return hf, edge.to_executorch().buffer


# Local (not imported from test_llama.py): under --import-mode=importlib test files are not importable.
def test_greedy_generation_matches_hf(family, runtime_path):
    hf, pte = family
    ours = list(Generator(pte, eos_token_ids=[]).generate_ids(PROMPT, NEW_TOKENS))
    assert ours == hf_greedy(hf, PROMPT, NEW_TOKENS)


def test_step_logits_match_hf(family, runtime_path):
    hf, pte = family
    assert_steps_match_hf(Generator(pte, eos_token_ids=[]), hf, PROMPT, steps=6)


def test_family_specific_weights():
    """The state-dict differences each family brings are there (and loaded strictly)."""
    keys = {name: set(loading.from_config(cls(**TINY), max_seq_len=MAX_SEQ_LEN).model.state_dict())
            for name, cls in CONFIGS.items()}
    attn = "model.layers.0.self_attn."
    assert {attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"} <= keys["qwen2"]
    assert attn + "o_proj.bias" not in keys["qwen2"]
    assert {attn + "q_norm.weight", attn + "k_norm.weight"} <= keys["qwen3"]
    assert not any(k.endswith(".bias") for k in keys["mistral"] | keys["qwen3"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_dir_loads(name, tmp_path, monkeypatch):
    """`from_hf_dir` accepts each model type; eager logits equal HF's on the saved weights."""
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: None)  # weights only: no tokenizer saved
    config = CONFIGS[name](**TINY)
    torch.manual_seed(1)
    hf = loading.hf_class(config)(config).eval()
    hf.save_pretrained(tmp_path)
    loaded = loading.from_hf_dir(tmp_path, max_seq_len=MAX_SEQ_LEN)
    with torch.no_grad():
        ours = loaded.model(torch.tensor([PROMPT]), torch.tensor([0]))[0, -1]
    torch.testing.assert_close(ours, hf_next_logits(hf, PROMPT), rtol=1e-5, atol=1e-5)


def test_sliding_window_smaller_than_cache_is_refused():
    config = MistralConfig(**TINY, sliding_window=16)
    with pytest.raises(ValueError, match="sliding_window 16 is smaller than the KV cache"):
        loading.from_config(config, max_seq_len=MAX_SEQ_LEN)
    assert loading.from_config(config, max_seq_len=16).model.args.max_seq_len == 16


def test_other_model_types_are_refused():
    config = LlamaConfig(**TINY)
    config.model_type = "gemma"
    with pytest.raises(ValueError, match="'gemma' is not a Llama-family model"):
        loading.from_config(config)
