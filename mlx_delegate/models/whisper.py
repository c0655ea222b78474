"""Whisper on the MLX delegate.

Two methods in one program, both built from a `transformers`
`WhisperForConditionalGeneration` (weights shared, not copied):

- `encode(features [1, n_mels, 2T]) -> cross_kv [L, 2, 1, H, T, Dh]`: the encoder
  followed by every decoder layer's cross-attention K/V projection, so a window's
  audio is projected once instead of once per token.
- `decode(token [1, 1], pos [1], cross_update [L, 2, 1, H, n, Dh]) -> logits [1, V]`: one
  decoder step. The self-attention caches and the cross-attention K/V are mutable
  buffers that stay inside the delegate; `cross_update` overwrites the first `n`
  cross positions. The first step of a window passes all of `cross_kv`, later steps
  its first two rows again (a no-op write; export's dynamic dims start at 2),
  because passing the whole 37 MB (Whisper base) to every call costs more than
  the step itself.

Lowering and greedy decoding are in `mlx_delegate.pipelines.whisper`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_TARGET = 448  # decoder positions (prompt included)


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*Dh] -> [B, H, T, Dh]."""
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, Dh] -> [B, T, H*Dh]."""
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class Encode(nn.Module):
    """Encoder and all cross-attention K/V projections of one window."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.encoder = model.model.encoder
        self.cross = nn.ModuleList(layer.encoder_attn for layer in model.model.decoder.layers)
        self.n_heads = model.config.decoder_attention_heads

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.encoder(features).last_hidden_state
        kv = [torch.stack([_heads(a.k_proj(h), self.n_heads), _heads(a.v_proj(h), self.n_heads)])
              for a in self.cross]
        return torch.stack(kv)


class DecodeStep(nn.Module):
    """One decoder token; self-attention caches and cross-attention K/V are buffers."""

    def __init__(self, model: nn.Module, max_len: int = MAX_TARGET) -> None:
        super().__init__()
        cfg = model.config
        self.decoder, self.proj_out = model.model.decoder, model.proj_out
        self.n_heads, self.max_len = cfg.decoder_attention_heads, max_len
        dh = cfg.d_model // self.n_heads
        dtype = self.proj_out.weight.dtype
        for i in range(cfg.decoder_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(1, self.n_heads, max_len, dh, dtype=dtype))
            self.register_buffer(f"v_cache_{i}", torch.zeros(1, self.n_heads, max_len, dh, dtype=dtype))
        self.register_buffer("cross_kv", torch.zeros(cross_kv_shape(model), dtype=dtype))

    def forward(self, token: torch.Tensor, pos: torch.Tensor, cross_update: torch.Tensor) -> torch.Tensor:
        # index_copy_ rather than a slice assignment, which would specialise the row count.
        rows = torch.arange(cross_update.shape[4], device=pos.device)
        cross_kv = self.cross_kv.index_copy_(4, rows, cross_update)
        dec = self.decoder
        x = dec.embed_tokens(token) + dec.embed_positions.weight.index_select(0, pos)[None]
        # Positions written so far (stale entries beyond `pos` from an earlier window are masked).
        mask = (torch.arange(self.max_len, device=pos.device) <= pos).view(1, 1, 1, self.max_len)
        for i, layer in enumerate(dec.layers):
            x = x + self._self_attention(layer.self_attn, layer.self_attn_layer_norm(x), pos, mask, i)
            a = layer.encoder_attn
            q = _heads(a.q_proj(layer.encoder_attn_layer_norm(x)), self.n_heads)
            x = x + a.out_proj(_merge(F.scaled_dot_product_attention(q, cross_kv[i, 0], cross_kv[i, 1])))
            h = layer.final_layer_norm(x)
            x = x + layer.fc2(F.gelu(layer.fc1(h)))
        return self.proj_out(dec.layer_norm(x))[:, -1]

    def _self_attention(self, a: nn.Module, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                        i: int) -> torch.Tensor:
        q, k, v = (_heads(p(h), self.n_heads) for p in (a.q_proj, a.k_proj, a.v_proj))
        k_cache = getattr(self, f"k_cache_{i}").index_copy_(2, pos, k)
        v_cache = getattr(self, f"v_cache_{i}").index_copy_(2, pos, v)
        return a.out_proj(_merge(F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)))


# --- Export -----------------------------------------------------------

def cross_kv_shape(model: nn.Module) -> tuple[int, ...]:
    cfg = model.config
    heads = cfg.decoder_attention_heads
    return (cfg.decoder_layers, 2, 1, heads, cfg.max_source_positions, cfg.d_model // heads)


def example_inputs(model: nn.Module) -> dict[str, tuple]:
    cfg = model.config
    features = torch.zeros(1, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    cross = torch.zeros(cross_kv_shape(model))
    return {"encode": (features,),
            "decode": (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), cross)}


def export(model: nn.Module, max_len: int | None = None) -> dict[str, torch.export.ExportedProgram]:
    """The `encode` and `decode` methods as exported programs."""
    max_len = max_len or model.config.max_target_positions
    inputs = example_inputs(model)
    modules = {"encode": Encode(model).eval(), "decode": DecodeStep(model, max_len).eval()}
    rows = torch.export.Dim("cross_rows", min=2, max=model.config.max_source_positions)
    shapes = {"encode": None, "decode": {"token": None, "pos": None, "cross_update": {4: rows}}}
    with torch.no_grad():
        return {k: torch.export.export(m, inputs[k], dynamic_shapes=shapes[k], strict=False)
                for k, m in modules.items()}
