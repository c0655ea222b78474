"""Fused multi-node patterns, applied to the Edge graph before partitioning.

Each module matches one decomposed form and replaces it by a single
`mlx_delegate::*` op (see `custom_ops.py`) whose handler maps it to an MLX
fused kernel. A rewrite happens only when that handler accepts the fused node,
so a pattern never takes work away from ExecuTorch that the delegate would
then refuse.

ExecuTorch asserts that a partitioner leaves the graph untouched, so the
patterns run as a transform pass ahead of it:

    to_edge_transform_and_lower(ep, transform_passes=[MLXPatternPass()],
                                partitioner=[MLXPartitioner()])
"""

from __future__ import annotations

import logging

from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (the fused ops)
from . import activations, attention, conv_activation, conv_batch_norm, layer_norm, linear_group, quantized_linear, rms_norm, rope

log = logging.getLogger(__name__)

PATTERNS = {"rms_norm": rms_norm.apply, "rope": rope.apply, "quantized": quantized_linear.apply}

# Fusions into ops the delegate already lowers (aten.layer_norm, gelu, silu, SDPA; linears
# sharing an input into one `linear_group`; eval-mode BatchNorm folded into the convolution
# before it, then the convolution's ReLU / ReLU6 / clamp fused into it). They run on each delegated graph in
# `MLXDelegateBackend.preprocess`, so every lowering gets them;
# `MLXPartitioner(disable={name})` switches one off, disable={"fusions"} all of them.
FUSIONS = {"fold_batch_norm": conv_batch_norm.apply, "fuse_conv_activation": conv_activation.apply,
           "fuse_layer_norm": layer_norm.apply,
           "fuse_activations": activations.apply, "fuse_attention": attention.apply,
           "fuse_linears": linear_group.apply}
ALL_FUSIONS = "fusions"


def apply_fusions(ep: ExportedProgram, disabled: frozenset[str] = frozenset()) -> dict[str, int]:
    """Run the enabled fusions on a delegated program; returns how often each fired."""
    if ALL_FUSIONS in disabled:
        return {}
    counts = {name: fn(ep) for name, fn in FUSIONS.items() if name not in disabled}
    if any(counts.values()):
        ep.graph.lint()
        ep.graph_module.recompile()
        log.info("mlx_delegate fusions: %s", counts)
    return counts


def apply_patterns(ep: ExportedProgram) -> dict[str, int]:
    """Rewrite `ep`'s graph in place; returns how often each pattern fired."""
    counts = {name: fn(ep) for name, fn in PATTERNS.items()}
    if any(counts.values()):
        ep.graph.lint()
        ep.graph_module.recompile()
        log.info("mlx_delegate patterns: %s", counts)
    return counts


class MLXPatternPass(ExportedProgramPassBase):
    """`apply_patterns` as an ExecuTorch transform pass; `counts` keeps the last run's tally."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def call(self, exported_program: ExportedProgram) -> ExportedProgramPassResult:
        self.counts = apply_patterns(exported_program)
        return ExportedProgramPassResult(exported_program, any(self.counts.values()))
