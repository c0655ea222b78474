"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE) for the Llama-family decoder.

Parameter names equal the `transformers` 5 modules' state dict (`mlp.gate.weight`,
`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]);
`fuse_expert_weights` turns the per-expert keys that `save_pretrained` writes
(Mixtral's `block_sparse_moe.experts.N.w1/w2/w3`, Qwen3-MoE's
`mlp.experts.N.gate_proj/up_proj/down_proj`) into those.

Routing: softmax over the router logits in float32, top-k, optionally
renormalised over the k chosen. The token-expert pairs are sorted by expert and
both expert products run as one grouped product each
(`mlx_delegate::grouped_mm`, MLX's `gather_mm` in the delegate), so shapes
depend on the token count only and one program serves prefill and decode.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..custom_ops import grouped_mm


class TopKRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, normalise: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.normalise = top_k, normalise

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) for tokens x [T, H]."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        tokens, k = experts.shape
        num_experts = self.gate_up_proj.shape[0]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        rows = torch.index_select(x, 0, order // k)
        counts = (flat[:, None] == torch.arange(num_experts, device=x.device)).sum(0)
        offsets = counts.cumsum(0)
        gate_up = grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offsets)
        # Back to (token, slot) order, then the routing-weighted sum over the k slots.
        out = torch.index_select(out, 0, torch.argsort(order)).view(tokens, k, -1)
        return (out * weights[..., None]).sum(1)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalise: bool) -> None:
        super().__init__()
        self.gate = TopKRouter(num_experts, hidden, top_k, normalise)
        self.experts = Experts(num_experts, hidden, intermediate)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.gate(flat)
        return self.experts(flat, weights, experts).reshape(shape)


# Per-expert checkpoint keys: prefix, expert, projection ((gate, up) or down) -> fused.
_PER_EXPERT = re.compile(r"^(.*\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.weight$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def fuse_expert_weights(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state_dict` with per-expert MoE weights stacked into the fused `mlp.experts.*` tensors and
    Mixtral's `block_sparse_moe.gate` renamed `mlp.gate`; other keys unchanged."""
    if not any(".experts." in k or "block_sparse_moe" in k for k in state_dict):
        return state_dict
    out: dict[str, Tensor] = {}
    found: dict[str, dict[str, dict[int, Tensor]]] = {}
    for key, value in state_dict.items():
        m = _PER_EXPERT.match(key)
        if m:
            found.setdefault(m[1], {}).setdefault(_ROLE[m[3]], {})[int(m[2])] = value
        else:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = value
    for prefix, roles in found.items():
        if set(roles) != {"gate", "up", "down"} or not roles["gate"].keys() == roles["up"].keys() == roles["down"].keys():
            raise ValueError(f"{prefix}: incomplete expert weights (have {sorted(roles)})")
        ids = sorted(roles["gate"])
        if ids != list(range(len(ids))):
            raise ValueError(f"{prefix}: expert ids {ids} are not 0..{len(ids) - 1}")
        out[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((roles["gate"][e], roles["up"][e])) for e in ids])
        out[prefix + "mlp.experts.down_proj"] = torch.stack([roles["down"][e] for e in ids])
    return out
