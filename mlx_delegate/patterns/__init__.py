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

The patterns whose parts the delegate lowers anyway (`IN_PREPROCESS`: RMSNorm,
RoPE, the KV-cache write, torchao's quantized linears and embeddings) also run in
`MLXDelegateBackend.preprocess` on each delegated graph, so a plain
`partitioner=[MLXPartitioner()]` lowering gets them too; `MLXPartitioner(disable={name})`
switches them off there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (the fused ops)
from . import (activations, attention, conv_batch_norm, conv_fusions, dequantized_constants, fake_quantize,
               inverted_residual, kv_cache, layer_norm, linear_activation, linear_group, linear_residual,
               quantized_epilogue, quantized_linear, rms_norm, rope, rope_kv)

log = logging.getLogger(__name__)

PATTERNS = {"rms_norm": rms_norm.apply, "rope": rope.apply, "kv_cache": kv_cache.apply,
            "quantized": quantized_linear.apply}
# Every name `MLXPatternPass(disable=...)` accepts: a pattern, or `rope_at`, the tensor-position form of
# `rope` alone (positions `pos + arange(L)` then stay composed: cos/sin tables node by node).
PATTERN_SWITCHES = sorted({*PATTERNS, "rope_at"})
# Patterns that only merge ops the delegate lowers one by one: safe to run on a delegated graph.
# `quantized` too: the delegate runs an unfused dequantize_affine as element-wise ops, so a plain
# `to_edge_transform_and_lower(..., partitioner=[MLXPartitioner()])` delegates torchao's linears, and
# without the pattern in preprocess they dequantized every weight per call into a float32 product.
IN_PREPROCESS = ("rms_norm", "rope", "kv_cache", "quantized")


def preprocess_switches(disabled: Iterable[str]) -> frozenset[str]:
    """The names of `disabled` (pattern switches) that `MLXPartitioner(disable=...)` must get too, so
    that preprocess does not fuse what the pattern pass was told to leave."""
    return frozenset(disabled) & {*IN_PREPROCESS, "rope_at"}


# Fusions into ops the delegate already lowers (aten.layer_norm, gelu, silu, SDPA; linears
# sharing an input into one `linear_group`; a linear's GELU / SiLU into it (`linear_act`); a residual add
# into the linear before it (`linear_residual`);
# eval-mode BatchNorm folded into the convolution before it, then a zero pad before the convolution,
# a residual add, a ReLU / ReLU6 / clamp and a hard-swish / SiLU / ... after it and a squeeze-excite
# gate on its input fused into it, then MobileNet's inverted-residual blocks into one node each).
# They run on each delegated graph in
# `MLXDelegateBackend.preprocess`, so every lowering gets them;
# `MLXPartitioner(disable={name})` switches one off, disable={"fusions"} all of them.
FUSIONS = {"fold_dequantized_weights": dequantized_constants.apply,  # first: the others want constant weights
           "fuse_fake_quantize": fake_quantize.apply,
           "fold_batch_norm": conv_batch_norm.apply,
           # before the convolution fusions: a written-out hard-swish becomes the op they take
           "fuse_activations": activations.apply,
           "fold_conv_pad": conv_fusions.fold_pad,
           "fuse_conv_residual": conv_fusions.fuse_residual, "fuse_conv_activation": conv_fusions.fuse_activation,
           "fuse_conv_scale": conv_fusions.fuse_scale,
           # after the four above: a 1x1 expand, depthwise and 1x1 project (their activations and the
           # residual already fused in) into one inverted-residual block
           "fuse_inverted_residual": inverted_residual.apply,
           "fuse_layer_norm": layer_norm.apply, "fuse_attention": attention.apply,
           "fuse_linears": linear_group.apply,
           # after fuse_activations (written-out GELU / SiLU become aten ops) and fuse_linears (a gate
           # grouped with its up projection stays grouped)
           "fuse_linear_activation": linear_activation.apply,
           # after the two above (a linear with an activation, or grouped, is not a plain linear any more): a
           # residual add into the linear before it, added to each output block in cache
           "fuse_linear_residual": linear_residual.apply,
           # after fuse_activations and fuse_linears: a grouped quantized gate / up with SiLU * up, and a
           # residual add, applied by the quantized product itself
           "fuse_quantized_glu": quantized_epilogue.fuse_glu,
           "fuse_quantized_residual": quantized_epilogue.fuse_residual,
           "fuse_quantized_norm": quantized_epilogue.fuse_norm,
           # after fuse_attention (written-out attention becomes the SDPA it matches): q's and k's RoPE and
           # both cache writes of a layer as one node
           "fuse_rope_kv_write": rope_kv.apply}
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


def check_pattern_switches(disabled: Iterable[str]) -> frozenset[str]:
    """`disabled` as a set; a name outside `PATTERN_SWITCHES` is an error that lists them."""
    disabled = frozenset(disabled)
    unknown = disabled - set(PATTERN_SWITCHES)
    if unknown:
        raise ValueError(f"unknown patterns {sorted(unknown)}; known: {PATTERN_SWITCHES}")
    return disabled


def apply_patterns(ep: ExportedProgram, disabled: Iterable[str] = (),
                   names: Iterable[str] = tuple(PATTERNS)) -> dict[str, int]:
    """Rewrite `ep`'s graph in place with the patterns of `names` not in `disabled` (names from
    `PATTERN_SWITCHES`); returns how often each pattern fired (0 for those left out)."""
    disabled = check_pattern_switches(disabled)
    options = {"rope": {"tensor_positions": "rope_at" not in disabled}}
    counts = {name: 0 if name in disabled else PATTERNS[name](ep, **options.get(name, {})) for name in names}
    if any(counts.values()):
        ep.graph.lint()
        ep.graph_module.recompile()
        log.info("mlx_delegate patterns: %s", counts)
    return counts


class MLXPatternPass(ExportedProgramPassBase):
    """`apply_patterns` as an ExecuTorch transform pass; `counts` keeps the last run's tally.

    Args:
        disable: patterns to leave out, for debugging and A/B benchmarks (`PATTERN_SWITCHES`).
    """

    def __init__(self, disable: Iterable[str] = ()) -> None:
        self.disabled = check_pattern_switches(disable)  # at construction, not deep inside a lowering
        self.counts: dict[str, int] = {}

    def call(self, exported_program: ExportedProgram) -> ExportedProgramPassResult:
        self.counts = apply_patterns(exported_program, self.disabled)
        return ExportedProgramPassResult(exported_program, any(self.counts.values()))
