"""ExecuTorch's own Llama export (the executorch wheel's `examples/models/llama`), as a peer for
`benchmarks/llm.py`: the same weights written as a Meta-format checkpoint + params.json, exported by
`export_llama_lib.export_llama` with its KV cache, custom SDPA / update-cache ops
(`use_sdpa_with_kv_cache`) and the XNNPACK partitioner; `qmode="8da4w"` quantizes the linears
(int8 dynamic activations, int4 weights, groups of `group_size`) as its int4 recipe does.

The program's forward is (tokens [1, L], input_pos [1]) -> logits of the last position.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from mlx_delegate.models.llama import Model
from mlx_delegate.pipelines.cache import cache_dir

# HF (our Model's) key -> Meta key, per layer where "{}" is the layer index.
META_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
}


def to_meta_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotate-half row order -> Meta's interleaved pairs (what ExecuTorch's Llama RoPE expects)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def meta_checkpoint(model: Model) -> dict[str, torch.Tensor]:
    a = model.args
    if a.attention_bias or a.qk_norm or a.mlp_bias:
        raise ValueError("only plain Llama layers map onto ExecuTorch's Llama example")
    out = {}
    for key, t in model.state_dict().items():
        parts = key.split(".")
        layer = parts[2] if key.startswith("model.layers.") else None
        pattern = key.replace(f".{layer}.", ".{}.", 1) if layer is not None else key
        if pattern not in META_KEYS:
            continue
        t = t.detach().float().clone()
        if pattern.endswith("q_proj.weight"):
            t = to_meta_rope(t, a.num_attention_heads)
        elif pattern.endswith("k_proj.weight"):
            t = to_meta_rope(t, a.num_key_value_heads)
        out[META_KEYS[pattern].format(layer)] = t
    if a.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _cache_key(checkpoint: dict[str, torch.Tensor], params: str, qmode: str | None, group_size: int,
               max_seq_len: int) -> str:
    """What the exported program depends on: the weights' bytes, the config and the executorch version."""
    from executorch import version

    h = hashlib.sha256(f"{params}|{qmode}|{group_size}|{max_seq_len}|{version.__version__}".encode())
    for key in sorted(checkpoint):
        h.update(key.encode())
        h.update(memoryview(checkpoint[key].contiguous().view(torch.uint8).reshape(-1).numpy()))
    return h.hexdigest()[:16]


def export(model: Model, out_dir: Path, *, qmode: str | None = None, group_size: int = 32,
           cache: bool = True) -> Path:
    """Export `model` (fp32 weights) with ExecuTorch's Llama recipe on XNNPACK; the .pte path.

    The export takes 10-20 minutes on 2 cores, so with `cache` the program is kept in the package's
    cache directory (`$MLX_DELEGATE_CACHE`), keyed by the weights' bytes and the options."""
    from executorch.examples.models.llama.export_llama_lib import export_llama
    from executorch.extension.llm.export.config.llm_config import LlmConfig

    a = model.args
    checkpoint = meta_checkpoint(model)
    params_json = json.dumps({
        "dim": a.hidden_size, "n_layers": a.num_hidden_layers, "n_heads": a.num_attention_heads,
        "n_kv_heads": a.num_key_value_heads, "vocab_size": a.vocab_size, "hidden_dim": a.intermediate_size,
        "head_dim": a.head_dim, "norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
        "use_scaled_rope": False, "use_hf_rope": False})
    cached = cache_dir() / f"et-llama-{_cache_key(checkpoint, params_json, qmode, group_size, a.max_seq_len)}.pte"
    if cache and cached.exists():
        return cached
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt, params = out_dir / "checkpoint.pth", out_dir / "params.json"
    torch.save(checkpoint, ckpt)
    del checkpoint
    params.write_text(params_json)
    cfg = LlmConfig()
    cfg.base.checkpoint, cfg.base.params = str(ckpt), str(params)
    cfg.model.use_kv_cache = cfg.model.use_sdpa_with_kv_cache = True
    cfg.model.enable_dynamic_shape = True
    cfg.export.max_seq_length = cfg.export.max_context_length = a.max_seq_len
    # A name ending in .pte is taken as the whole path (a bare one would land in the working directory).
    cfg.export.output_dir, cfg.export.output_name = str(out_dir), str(out_dir / "model.pte")
    cfg.backend.xnnpack.enabled = True
    cfg.backend.xnnpack.extended_ops = True
    if qmode:
        cfg.quantization.qmode, cfg.quantization.group_size = qmode, group_size
    pte = Path(export_llama(cfg))
    ckpt.unlink()
    if not cache:
        return pte
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    shutil.move(pte, tmp)
    tmp.replace(cached)  # atomic: a concurrent run never reads half a file
    return cached
