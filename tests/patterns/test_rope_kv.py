"""`fuse_rope_kv_write` (`patterns/rope_kv.py`): q's and k's RoPE and both KV-cache writes of an
attention layer become one RopeKvWriteNode (on the CPU one primitive updating the caches in place),
which also reads [B, L, H, D] projections through their transposes (`seq_first`).
An attention layer written with the delegate's custom ops (as `mlx_delegate.models`' Llama writes
it), GQA, one to three query rows, fp32 / bf16 / fp16, positions at the first slot, the middle and
the last: eager PyTorch against node by node, compiled (replayed across positions) and the kernels
off (MLX's rope and slice updates), through the stock runtime. Llama-family programs (ours, and
transformers' static-cache export) are checked in tests/models and tests/patterns/test_kv_cache.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import _runtime, custom_ops
from mlx_delegate.testing import cases, lower_and_compare, runtime_switches

from .test_rope_at import payload_nodes

HQ, HK, S, D = 4, 2, 16, 8


class AttentionStep(torch.nn.Module):
    """RoPE on q and k at `pos`, k and v written into resident caches there, attention over the
    whole cache under the position mask (the Llama export's decode / prefill step)."""

    def __init__(self, traditional: bool = False, seq_first: bool = False) -> None:
        super().__init__()
        self.traditional, self.seq_first = traditional, seq_first
        # Random initial caches: entries not written this step must come through unchanged.
        self.register_buffer("k_cache", torch.randn(1, HK, S, D), persistent=False)
        self.register_buffer("v_cache", torch.randn(1, HK, S, D), persistent=False)
        self.register_buffer("inv_freq", 1.0 / (500.0 ** (torch.arange(0, D, 2).float() / D)), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.seq_first:  # projections [B, L, H, D], transposed as a Llama layer does
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        q = custom_ops.rope_at(q, self.inv_freq, pos, self.traditional, None)
        k = custom_ops.rope_at(k, self.inv_freq, pos, self.traditional, None)
        self.k_cache.copy_(custom_ops.kv_cache_update_at(self.k_cache, k, pos))
        self.v_cache.copy_(custom_ops.kv_cache_update_at(self.v_cache, v, pos))
        positions = pos + torch.arange(q.shape[2])
        mask = torch.arange(S)[None, :] <= positions[:, None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def step_inputs(length: int, pos: int, seq_first: bool = False) -> tuple:
    def make(heads: int) -> torch.Tensor:
        return torch.randn(1, length, heads, D) if seq_first else torch.randn(1, heads, length, D)
    return make(HQ), make(HK), make(HK), torch.tensor([pos])


def rows(length: int, traditional: bool = False, seq_first: bool = False) -> list:
    # First slot, the middle, the last slot (the compiled graph replays across them).
    name = f"rope_kv_write-L{length}{'-traditional' if traditional else ''}{'-seq_first' if seq_first else ''}"
    return cases(name, lambda: AttentionStep(traditional, seq_first), lambda: step_inputs(length, 0, seq_first),
                 (torch.float32, torch.bfloat16, torch.float16), is_module=True,
                 more_inputs=lambda: [step_inputs(length, S // 2, seq_first),
                                      step_inputs(length, S - length, seq_first)])


CASES = rows(1) + rows(2) + rows(1, traditional=True) + rows(1, seq_first=True) + rows(3, seq_first=True)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rope_kv_write_matches_eager(case) -> None:
    counts = _runtime.cpu_kernel_call_counts().get("rope_kv_write", 0)
    lowered = lower_and_compare(case)
    nodes = payload_nodes(lowered.edge)
    kinds = [type(n).__name__ for n in nodes]
    assert kinds.count("RopeKvWriteNode") == 1, kinds
    assert "RopeNode" not in kinds and "DynamicSliceUpdateNode" not in kinds, kinds
    # The projections' transposes are read through their strides, not run.
    fused = next(n for n in nodes if type(n).__name__ == "RopeKvWriteNode")
    assert fused.seq_first == ("seq_first" in case.name) and "TransposeNode" not in kinds, kinds
    if _runtime.cpu_kernels_enabled():
        assert _runtime.cpu_kernel_call_counts().get("rope_kv_write", 0) > counts


E = 24


class ProjectedStep(AttentionStep):
    """`AttentionStep` on q, k and v projected from one input (a Llama layer's q_proj / k_proj / v_proj,
    grouped into one product by `fuse_linears`): the runtime reads them from that product in place."""

    def __init__(self) -> None:
        super().__init__(seq_first=True)
        self.q_proj = torch.nn.Linear(E, HQ * D, bias=False)
        self.k_proj = torch.nn.Linear(E, HK * D, bias=False)
        self.v_proj = torch.nn.Linear(E, HK * D, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, -1, D) for p in (self.q_proj, self.k_proj, self.v_proj))
        return super().forward(q, k, v, pos)


def projected_inputs(length: int, pos: int) -> tuple:
    return torch.randn(1, length, E), torch.tensor([pos])


@pytest.mark.parametrize("case", [c for length in (1, 3) for c in cases(
    f"rope_kv_write-projected-L{length}", ProjectedStep, lambda length=length: projected_inputs(length, 0),
    (torch.float32, torch.bfloat16, torch.float16), is_module=True,
    more_inputs=lambda length=length: [projected_inputs(length, S // 2), projected_inputs(length, S - length)])],
    ids=str)
def test_projections_read_in_place(case) -> None:
    """q, k and v sliced from one grouped product: read from it (counter `rope_kv_write_packed`), not
    through their slice and reshape nodes, with eager's results; the kernels-off run (inside
    lower_and_compare) keeps the slices."""
    counts = _runtime.cpu_kernel_call_counts()
    lowered = lower_and_compare(case)
    kinds = [type(n).__name__ for n in payload_nodes(lowered.edge)]
    assert kinds.count("RopeKvWriteNode") == 1 and kinds.count("SliceNode") == 3, kinds
    if _runtime.cpu_kernels_enabled():
        after = _runtime.cpu_kernel_call_counts()
        assert after.get("rope_kv_write_packed", 0) > counts.get("rope_kv_write_packed", 0)
        assert after.get("rope_kv_write", 0) == counts.get("rope_kv_write", 0)


def test_write_past_the_end_is_an_error() -> None:
    (case,) = cases("rope_kv_write-bounds", AttentionStep, lambda: step_inputs(2, 0), is_module=True)
    lowered = lower_and_compare(case)
    for compiled in (False, True):
        with runtime_switches(compile=compiled):
            method = lowered.fresh_method()
            for _ in range(3):
                method.execute(list(step_inputs(2, 3)))
            with pytest.raises(RuntimeError):
                method.execute(list(step_inputs(2, S - 1)))


def test_switch_off_keeps_the_parts() -> None:
    from mlx_delegate import MLXPartitioner

    (case,) = cases("rope_kv_write-off", AttentionStep, lambda: step_inputs(1, 0), is_module=True)
    lowered = lower_and_compare(case, partitioner=MLXPartitioner(disable={"fuse_rope_kv_write"}))
    kinds = [type(n).__name__ for n in payload_nodes(lowered.edge)]
    assert "RopeKvWriteNode" not in kinds and kinds.count("RopeNode") == 2 and kinds.count("DynamicSliceUpdateNode") == 2
