"""`MLXPartitioner`: tags the nodes our handlers can lower.

Support is decided by dry-running the real handler (`ProgramBuilder` in check
mode), so a tagged node always lowers. Constants feeding tagged nodes and
buffers the delegated graph mutates are tagged too, so they live inside the
delegate.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Callable, Iterable

import torch
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer
from torch.export import ExportedProgram
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from . import ops  # noqa: F401  (registers every handler)
from . import registry
from .backend import MLXDelegateBackend
from .builder import ProgramBuilder
from .errors import Unsupported
from .passes import GRAPH_PASSES, RUNTIME_SWITCHES, decompositions
from .patterns import ALL_FUSIONS, FUSIONS, IN_PREPROCESS, quantized_linear

log = logging.getLogger(__name__)


def check_node(n: torch.fx.Node) -> str | None:
    """None when `n` can be lowered, else the reason it cannot."""
    if n.op != "call_function":
        return "not a call"
    b = ProgramBuilder(check_only=True)
    try:
        b.lower_node(n)
    except Unsupported as e:
        return str(e)
    return None


class _HandlerSupport(OperatorSupportBase):
    def __init__(self, exclude: frozenset[str]) -> None:
        self.rejected: dict[str, str] = {}
        self._user_lower: dict[str, int] = {}
        self.exclude = exclude

    def is_node_supported(self, submodules: Any, n: torch.fx.Node) -> bool:
        if n.op != "call_function":
            return False
        if n.target is operator.getitem:
            src = n.args[0]
            return isinstance(src, torch.fx.Node) and self.is_node_supported(submodules, src)
        if registry.base_name(n.target) in self.exclude:
            reason = "excluded by MLXPartitioner(exclude=...)"
        else:
            reason = check_node(n)
        if reason is not None:
            self.rejected[n.name] = reason
        return reason is None


# Every name `MLXPartitioner(disable=...)` accepts.
SWITCHES = sorted({*GRAPH_PASSES, *RUNTIME_SWITCHES, *FUSIONS, ALL_FUSIONS, *IN_PREPROCESS, "rope_at"})


class MLXPartitioner(Partitioner):
    """Partition an Edge program for the MLX delegate.

    Args:
        compile_specs: extra specs passed to `MLXDelegateBackend.preprocess`.
        exclude: op base names (e.g. "exp", "view_copy") to leave to ExecuTorch, for debugging.
        disable: optimisations to turn off, for debugging: graph passes (`passes.GRAPH_PASSES`),
            runtime switches (`passes.RUNTIME_SWITCHES`), fusions (`patterns.FUSIONS`, or
            "fusions" for all of them) and the patterns preprocess applies when `MLXPatternPass` has not
            (`patterns.IN_PREPROCESS`, and "rope_at").
    """

    def __init__(self, compile_specs: list[CompileSpec] | None = None, *,
                 exclude: Iterable[str] = (), disable: Iterable[str] = ()) -> None:
        super().__init__()
        self.exclude = frozenset(exclude)
        unknown = set(disable) - set(SWITCHES)
        if unknown:
            raise ValueError(f"unknown optimisations {sorted(unknown)}; known: {SWITCHES}")
        specs = list(compile_specs or [])
        if disable:
            specs.append(CompileSpec("disable", ",".join(sorted(disable)).encode()))
        self.delegation_spec = DelegationSpec(MLXDelegateBackend.__name__, specs)
        self.rejected: dict[str, str] = {}

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        # The edge program shares its state and constants tables with the user's
        # ExportedProgram; lowering deletes the entries it takes into a delegate,
        # which would leave the user's program unusable (a second lowering fails).
        exported_program._state_dict = dict(exported_program.state_dict)
        exported_program._constants = dict(exported_program.constants)
        support = _HandlerSupport(self.exclude)
        partitioner = CapabilityBasedPartitioner(
            exported_program.graph_module, support, allows_single_node_partition=True)
        tags: dict[str, DelegationSpec] = {}
        spec = self._spec_with_lower_bounds(exported_program)
        for p in partitioner.propose_partitions():
            if not any(_does_work(n) for n in p.nodes):
                continue  # a partition of views and getitems alone is not worth a delegate call
            tag = f"mlx_delegate_{p.id}"
            for n in p.nodes:
                n.meta["delegation_tag"] = tag
            tags[tag] = spec
        tag_constant_data(exported_program)
        tag_mutated_buffer(exported_program)
        self.rejected = support.rejected
        for name, reason in support.rejected.items():
            log.info("mlx_delegate: %s stays on ExecuTorch: %s", name, reason)
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)

    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        """Decomposes the non-core ops that no default decomposition removes (`histc`) and repacks
        ExecuTorch's exportable torchao weight formats (int4 / NVFP4 / MX, `quantized_linear.apply_formats`):
        left as they are, ExecuTorch's Edge verifier rejects the whole program before any partitioner
        sees them."""
        # The user's dynamic ranges, before re-tracing narrows Dim(min=1) to start at 2.
        self._user_lower = {str(sym): int(vr.lower) for sym, vr in exported_program.range_constraints.items()
                            if vr.lower.is_finite}
        return quantized_linear.apply_formats(decompositions.apply(exported_program))

    def _spec_with_lower_bounds(self, ep: ExportedProgram) -> DelegationSpec:
        """The delegation spec, plus the user's lower bounds of the sizes lowering narrowed."""
        narrowed = [f"{sym}={lo}" for sym, vr in ep.range_constraints.items()
                    if (lo := self._user_lower.get(str(sym))) is not None and vr.lower.is_finite and lo < int(vr.lower)]
        if not narrowed:
            return self.delegation_spec
        specs = [*self.delegation_spec.compile_specs, CompileSpec("lower_bounds", ",".join(narrowed).encode())]
        return DelegationSpec(self.delegation_spec.backend_id, specs)

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[torch.fx.Node], bool] | None]:
        """Keep ops we lower as a whole (linear, gelu, sdpa, ...) out of the core ATen decompositions.

        An op is kept only when it is in `ep` and every one of its nodes lowers, and no per-node
        check is returned: ExecuTorch's per-node path (EDGE_DO_NOT_DECOMP) re-traces kept
        ops with other output strides, which breaks the `view`s recorded after them
        (SDPA followed by transformers' or nn.MultiheadAttention's reshape).
        """
        nodes: dict[Any, list[torch.fx.Node]] = {}
        for gm in _graph_modules(ep.graph_module):
            for n in gm.graph.nodes:
                if n.op == "call_function":
                    nodes.setdefault(n.target, []).append(n)
        # Only ops present now: ExecuTorch then requires every node of a kept op to be delegated,
        # including nodes that appear later (a dim-order copy made from an aten._to_copy we refuse).
        keep = [op for op in _kept_ops() if op in nodes and registry.base_name(op) not in self.exclude
                and all(check_node(n) is None for n in nodes[op])]
        return keep, None


def _graph_modules(gm: torch.fx.GraphModule) -> Iterable[torch.fx.GraphModule]:
    """`gm` and the graphs of its control-flow branches."""
    yield gm
    for child in gm.children():
        if isinstance(child, torch.fx.GraphModule):
            yield from _graph_modules(child)


_NO_WORK = {"view_copy", "alias_copy", "getitem", "sym_size", "_assert_scalar", "sym_constrain_range_for_size"}


def _does_work(n: torch.fx.Node) -> bool:
    return registry.base_name(n.target) not in _NO_WORK


@functools.cache
def _kept_ops() -> list[Any]:
    """Registered ops that the default decompositions would otherwise split up."""
    from torch._decomp import core_aten_decompositions

    decomposed = set(core_aten_decompositions().keys())

    def functional(op: torch._ops.OpOverload) -> bool:
        # ExecuTorch only preserves ops that neither mutate nor alias.
        s = op._schema
        return not s.is_mutable and not any(r.alias_info for r in s.returns)

    return [t for t in registry.registered_targets()
            if isinstance(t, torch._ops.OpOverload) and t in decomposed and functional(t)]
