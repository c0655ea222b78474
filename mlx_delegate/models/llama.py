"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, and the
mixture-of-experts Mixtral and Qwen3-MoE with the MLP of `models.moe`) written for export.

Parameter names equal the state-dict keys of `transformers`' `*ForCausalLM` class
for each family in `FAMILIES` (Qwen2 adds q/k/v biases, Qwen3 per-head q/k RMSNorm). The
KV cache is a pair of registered (non-persistent) buffers per layer, written
with `mlx_delegate::kv_cache_update_at`, so an exported program keeps it
resident in the delegate. `forward(tokens, input_pos)` serves prefill (any
length) and decode (length 1) alike.

The position stays a tensor end to end (no `item()`): the cache is written at
a tensor offset, RoPE's angles come from `input_pos + arange(L)`, and attention
reads the whole cache under the mask `arange(max_seq_len) <= position`. Shapes
then depend on L only, so every decode step has one signature and the delegate
serves them all with one compiled graph. RMSNorm and RoPE are written in plain
torch (the HF form) and fused into MLX's kernels at lowering (RoPE with the
position as an array offset: `mlx_delegate::rope_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..custom_ops import kv_cache_update_at
from .moe import SparseMoeBlock

# RoPE variants whose cos/sin need no post-scaling (HF's attention_scaling == 1).
SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Family:
    hf_class: str  # the `transformers` class whose state-dict keys the model shares
    qkv_bias: bool | None = None  # None: the config's attention_bias
    o_proj_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE
    moe: bool = False  # mixture-of-experts MLP (models.moe)
    norm_topk_prob: bool | None = None  # renormalise the routing weights; None: the config's


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, o_proj_bias=False),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "mixtral": Family("MixtralForCausalLM", moe=True, norm_topk_prob=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, moe=True),
}


def family(config: Any) -> Family:
    """The `FAMILIES` entry for an HF config, or a ValueError naming the supported model types."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a Llama-family model "
                         f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def sliding_window(config: Any) -> int | None:
    """The attention window HF applies on some layer, or None when every layer attends to all."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return getattr(config, "sliding_window", None)


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # on q/k/v (and o_proj unless o_proj_bias says otherwise)
    o_proj_bias: bool | None = None
    qk_norm: bool = False
    mlp_bias: bool = False
    max_seq_len: int = 2048  # KV-cache length
    rope_parameters: dict[str, Any] | None = None
    num_experts: int = 0  # > 0: mixture-of-experts MLP (models.moe) except in dense_layers
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # per expert (default: intermediate_size)
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is not in 1..{self.num_experts}")

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers

    @classmethod
    def from_hf(cls, config: Any, max_seq_len: int | None = None) -> "ModelArgs":
        """From a `transformers` config of one of the `FAMILIES` (Llama, Mistral, Qwen2, Qwen3)."""
        fam = family(config)
        max_seq_len = max_seq_len or min(config.max_position_embeddings, 2048)
        window = sliding_window(config)
        if window is not None and window < max_seq_len:
            # The cache keeps every position and each query attends to all of them.
            raise ValueError(f"sliding_window {window} is smaller than the KV cache ({max_seq_len}): "
                             f"sliding-window attention is not supported; use max_seq_len <= {window}")
        bias = bool(getattr(config, "attention_bias", False))
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE:
            raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE)} are)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        moe: dict[str, Any] = {}
        if fam.moe:
            layers = config.num_hidden_layers
            step = getattr(config, "decoder_sparse_step", 1) or 1
            only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
            moe = dict(
                num_experts=getattr(config, "num_local_experts", None) or config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
                norm_topk_prob=bool(config.norm_topk_prob if fam.norm_topk_prob is None else fam.norm_topk_prob),
                dense_layers=tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step))
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps, rope_theta=rope.get("rope_theta", 10000.0),
            head_dim=getattr(config, "head_dim", None), tie_word_embeddings=bool(config.tie_word_embeddings),
            attention_bias=bias if fam.qkv_bias is None else fam.qkv_bias,
            o_proj_bias=bias if fam.o_proj_bias is None else fam.o_proj_bias,
            qk_norm=fam.qk_norm, mlp_bias=bool(getattr(config, "mlp_bias", False)),
            max_seq_len=max_seq_len,
            rope_parameters={**rope, "rope_type": rope_type}, **moe,
        )


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """base ** (-2i / D), with HF's frequency scaling for linear / llama3 RoPE."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rope = args.rope_parameters or {}
    if rope.get("rope_type", "default") == "default":
        return inv_freq
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                         head_dim=dim, rope_parameters=dict(rope))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert scaling == 1.0, "RoPE with attention scaling is not supported"
    return inv_freq.float()


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads, args.num_key_value_heads, args.head_dim)
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=args.o_proj_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        cache = (1, self.n_kv_heads, args.max_seq_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache), persistent=False)

    def forward(self, x: Tensor, input_pos: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.k_cache.copy_(kv_cache_update_at(self.k_cache, k, input_pos))
        self.v_cache.copy_(kv_cache_update_at(self.v_cache, v, input_pos))
        # The whole cache, fixed shape; `mask` hides the entries past each query.
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        # An explicit copy: SDPA's output strides differ once the op is kept whole
        # (to_edge re-traces), and a recorded view would no longer be valid.
        out = out.transpose(1, 2).clone(memory_format=torch.contiguous_format)
        return self.o_proj(out.view(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp: nn.Module = MLP(args)
        if args.is_moe_layer(index):
            self.mlp = SparseMoeBlock(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                      args.num_experts_per_tok, args.norm_topk_prob)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), input_pos, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.max_seq_len = args.max_seq_len

    def forward(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        L = tokens.shape[1]
        h = self.embed_tokens(tokens)
        positions = input_pos.reshape(1) + torch.arange(L, device=tokens.device)  # [L]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        # Query i (at input_pos + i) sees cache entries 0..input_pos + i.
        mask = torch.arange(self.max_seq_len, device=tokens.device)[None, :] <= positions[:, None]
        for layer in self.layers:
            h = layer(h, input_pos, cos, sin, mask)
        return self.norm(h)


class Model(nn.Module):
    """HF `*ForCausalLM`-compatible (see `FAMILIES`):
    forward(tokens [1, L], input_pos [1]) -> logits [1, L, vocab]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, tokens: Tensor, input_pos: Tensor, last_only: bool = False) -> Tensor:
        """`input_pos` ([1] int) is where tokens[0, 0] goes in the cache; the tokens must fit
        (input_pos + L <= max_seq_len): eager runs raise otherwise, and so does the delegate."""
        torch._check(tokens.shape[1] <= self.args.max_seq_len)
        h = self.model(tokens, input_pos)
        if last_only:
            h = h[:, -1:]
        if self.args.tie_word_embeddings:
            embed = self.model.embed_tokens
            return embed.attend(h) if hasattr(embed, "attend") else F.linear(h, embed.weight)
        return self.lm_head(h)

    def to_dtype(self, dtype: torch.dtype) -> "Model":
        """Weights and caches in `dtype`; the RoPE frequencies stay float32 (as HF keeps them)."""
        self.to(dtype)
        self.model.inv_freq = rope_inv_freq(self.args)
        return self

    def reset_cache(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.k_cache.zero_()
            layer.self_attn.v_cache.zero_()
