"""Layer / RMS / group / batch norm and linalg.vector_norm parity."""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate.ir import nodes as N
from mlx_delegate.partitioner import MLXPartitioner
from mlx_delegate.testing import FLOATS, cases, lower_and_compare

aten = torch.ops.aten
# Export specialises sizes 0 and 1, so dynamic ranges start at 2.
batch = Dim("batch", min=2, max=16)
seq = Dim("seq", min=2, max=64)


def randn(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


def dyn(*specs):
    """dynamic_shapes for a `Lambda` (its inputs arrive as one *args tuple)."""
    return (specs,)


def affine(module: torch.nn.Module) -> torch.nn.Module:
    """Random (not identity) affine parameters, so that weight and bias are really checked."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


class BatchNorm(torch.nn.Module):
    """An eval-mode BatchNorm with non-trivial running statistics."""

    def __init__(self, cls: type, channels: int, affine_params: bool = True) -> None:
        super().__init__()
        self.bn = cls(channels, affine=affine_params)
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.randn(channels))
            self.bn.running_var.copy_(torch.rand(channels) + 0.5)
        if affine_params:
            affine(self.bn)

    def forward(self, x):
        return self.bn(x)


LAYER_NORMS = [
    # (name, module factory, input shape)
    ("layer_norm", lambda: affine(torch.nn.LayerNorm(16)), (2, 5, 16)),
    ("layer_norm_2d_shape", lambda: affine(torch.nn.LayerNorm((4, 6))), (3, 4, 6)),
    ("layer_norm_3d_shape", lambda: affine(torch.nn.LayerNorm((2, 3, 4))), (2, 2, 3, 4)),
    ("layer_norm_no_affine", lambda: torch.nn.LayerNorm(8, elementwise_affine=False), (4, 8)),
    ("layer_norm_no_bias", lambda: affine(torch.nn.LayerNorm(8, bias=False)), (4, 8)),
    ("rms_norm", lambda: affine(torch.nn.RMSNorm(16)), (2, 5, 16)),
    ("rms_norm_eps", lambda: affine(torch.nn.RMSNorm(16, eps=1e-3)), (3, 16)),
    ("rms_norm_2d_shape", lambda: affine(torch.nn.RMSNorm((3, 8))), (2, 3, 8)),
    ("rms_norm_no_weight", lambda: torch.nn.RMSNorm(8, elementwise_affine=False), (4, 8)),
    ("group_norm", lambda: affine(torch.nn.GroupNorm(2, 6)), (2, 6, 4, 5)),
    ("group_norm_1d", lambda: affine(torch.nn.GroupNorm(4, 8)), (3, 8, 7)),
    ("group_norm_3d", lambda: affine(torch.nn.GroupNorm(3, 6)), (1, 6, 2, 3, 4)),
    ("group_norm_per_channel", lambda: affine(torch.nn.GroupNorm(4, 4)), (2, 4, 3, 3)),
    ("group_norm_no_affine", lambda: torch.nn.GroupNorm(1, 4, affine=False), (2, 4, 5)),
    ("group_norm_no_spatial", lambda: affine(torch.nn.GroupNorm(2, 4)), (3, 4)),
    ("batch_norm1d", lambda: BatchNorm(torch.nn.BatchNorm1d, 4), (3, 4)),
    ("batch_norm1d_seq", lambda: BatchNorm(torch.nn.BatchNorm1d, 4), (2, 4, 7)),
    ("batch_norm2d", lambda: BatchNorm(torch.nn.BatchNorm2d, 3), (2, 3, 5, 4)),
    ("batch_norm2d_no_affine", lambda: BatchNorm(torch.nn.BatchNorm2d, 3, affine_params=False), (2, 3, 4, 4)),
    ("batch_norm3d", lambda: BatchNorm(torch.nn.BatchNorm3d, 2), (1, 2, 3, 4, 2)),
    ("instance_norm2d", lambda: affine(torch.nn.InstanceNorm2d(3, affine=True)), (2, 3, 5, 6)),
    ("instance_norm1d_no_affine", lambda: torch.nn.InstanceNorm1d(4), (2, 4, 9)),
]

CASES = [c for name, make, shape in LAYER_NORMS for c in cases(name, make, randn(shape), FLOATS, is_module=True)]
CASES += [
    # functional forms, non-contiguous inputs, empty batches
    *cases("layer_norm_fn_noncontig", lambda x, w, b: F.layer_norm(x.transpose(0, 1), (6,), w, b, eps=1e-3),
           randn((5, 4, 6), (6,), (6,)), FLOATS),
    *cases("group_norm_fn_noncontig", lambda x, w, b: F.group_norm(x.transpose(2, 3), 2, w, b),
           randn((2, 4, 3, 5), (4,), (4,)), FLOATS),
    *cases("batch_norm_fn_noncontig", lambda x, m, v, w, b: F.batch_norm(x.transpose(2, 3), m, v.abs() + 0.1, w, b),
           randn((2, 3, 4, 5), (3,), (3,), (3,), (3,)), FLOATS),
    *cases("rms_norm_fn_noncontig", lambda x, w: F.rms_norm(x.transpose(0, 1), (4,), w), randn((6, 3, 4), (4,)),
           FLOATS),
    *cases("layer_norm_empty_batch", lambda x: F.layer_norm(x, (8,)), randn((0, 8)), (torch.float32,)),
    *cases("group_norm_empty_batch", lambda x: F.group_norm(x, 2), randn((0, 4, 3)), (torch.float32,)),
    # saved statistics of the native ops, when read
    *cases("native_layer_norm_stats", lambda x, w, b: aten.native_layer_norm(x, [3, 4], w, b, 1e-5),
           randn((2, 3, 4), (3, 4), (3, 4)), FLOATS),
    *cases("native_layer_norm_rstd_only", lambda x: aten.native_layer_norm(x, [8], None, None, 1e-5)[2],
           randn((5, 8)), FLOATS),
    *cases("native_group_norm_stats", lambda x, w, b: aten.native_group_norm(x, w, b, 2, 6, 12, 3, 1e-5),
           randn((2, 6, 3, 4), (6,), (6,)), FLOATS),
    *cases("batch_norm_training_no_stats", lambda x, w, b: aten._native_batch_norm_legit.no_stats(
        x, w, b, True, 0.1, 1e-5), randn((3, 4, 5), (4,), (4,)), FLOATS),
    # dynamic shapes
    *cases("layer_norm_dynamic", lambda: affine(torch.nn.LayerNorm(16)), randn((2, 5, 16)), (torch.float32,),
           is_module=True, dynamic_shapes=({0: batch, 1: seq},),
           more_inputs=lambda: [(torch.randn(3, 17, 16),), (torch.randn(2, 2, 16),)]),
    *cases("rms_norm_dynamic", lambda: affine(torch.nn.RMSNorm(16)), randn((2, 5, 16)), FLOATS,
           is_module=True, dynamic_shapes=({1: Dim("tokens", min=1, max=64)},),
           more_inputs=lambda: [(torch.randn(2, 33, 16),), (torch.randn(2, 1, 16),)]),
    *cases("group_norm_dynamic", lambda: affine(torch.nn.GroupNorm(2, 4)), randn((2, 4, 6, 6)), (torch.float32,),
           is_module=True, dynamic_shapes=({0: batch, 2: seq},), more_inputs=lambda: [(torch.randn(5, 4, 9, 6),)]),
    *cases("batch_norm_dynamic", lambda: BatchNorm(torch.nn.BatchNorm2d, 3), randn((2, 3, 4, 4)), (torch.float32,),
           is_module=True, dynamic_shapes=({0: batch, 3: seq},), more_inputs=lambda: [(torch.randn(6, 3, 4, 11),)]),
]

# linalg.vector_norm: ExecuTorch's own decomposition table splits it up unless a
# partitioner keeps it, so these rows run both ways (decomposed, and kept whole).
VECTOR_NORMS = [
    ("vector_norm_l2_last", lambda x: torch.linalg.vector_norm(x, dim=-1)),
    ("vector_norm_l1_keepdim", lambda x: torch.linalg.vector_norm(x, 1, dim=(0, 2), keepdim=True)),
    ("vector_norm_inf", lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1)),
    ("vector_norm_neg_inf", lambda x: torch.linalg.vector_norm(x, float("-inf"))),
    ("vector_norm_p3_all", lambda x: torch.linalg.vector_norm(x, 3)),
    ("vector_norm_noncontig", lambda x: torch.linalg.vector_norm(x.transpose(0, 2), dim=0)),
    ("vector_norm_normalize", lambda x: F.normalize(x, dim=-1)),
]
VECTOR_NORM_CASES = [c for name, fn in VECTOR_NORMS for c in cases(name, fn, randn((3, 4, 5)), FLOATS)]
CASES += VECTOR_NORM_CASES

# Inference batch norm's saved statistics are empty placeholders: reading them
# keeps the op on ExecuTorch. (Training-mode batch norm with running statistics
# cannot reach a partitioner at all: ExecuTorch's verifier rejects it.)
CASES += cases("batch_norm_placeholder_stats_refused",
               lambda x, m, v: aten._native_batch_norm_legit_no_training(x, None, None, m, v, 0.1, 1e-5)[:2],
               lambda: (torch.randn(3, 4, 5), torch.randn(4), torch.rand(4) + 0.5), (torch.float32,), segments=0,
               allowed_fallback=frozenset({"_native_batch_norm_legit_no_training"}))


class KeepVectorNorm(MLXPartitioner):
    """Also keeps linalg_vector_norm whole, so that its own handler is exercised."""

    def ops_to_not_decompose(self, ep):
        ops, check = super().ops_to_not_decompose(ep)
        return [*ops, aten.linalg_vector_norm.default], check


@pytest.mark.parametrize("case", CASES, ids=str)
def test_norm(case):
    lower_and_compare(case)


@pytest.mark.parametrize("case", VECTOR_NORM_CASES, ids=str)
def test_vector_norm_kept_whole(case):
    lowered = lower_and_compare(case, partitioner=KeepVectorNorm())
    payload = next(m.processed_bytes for _, m in lowered.edge.exported_program().graph_module.named_children()
                   if hasattr(m, "processed_bytes"))
    assert "VectorNormNode" in {type(i.node).__name__ for i in N.deserialize(payload).instructions}
