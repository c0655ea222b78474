"""Decompositions for non-core ATen ops that torch has none for.

Such an op survives `run_decompositions` and ExecuTorch's Edge verifier then
rejects the program (for every backend). Expressed here in core ops, the
program lowers and each piece is partitioned like any other node.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::grouped_mm)

aten = torch.ops.aten


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    """Counts per equal-width bin of [min, max] (transformers' MoE counts tokens per expert with it);
    values outside, and NaN, are not counted; max itself falls in the last bin. A bin per column of
    an (elements x bins) comparison: meant for few bins."""
    if not min < max:
        raise NotImplementedError("histc with min >= max takes its range from the data")
    flat = x.reshape(-1)
    index = torch.floor((flat - min) * (bins / (max - min))).clamp(max=bins - 1)
    inside = (flat >= min) & (flat <= max)
    hits = (index.unsqueeze(1) == torch.arange(bins, dtype=x.dtype)) & inside.unsqueeze(1)
    return hits.to(x.dtype).sum(0)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The mixture-of-experts form (2D x 3D with offsets) of `torch._grouped_mm` (transformers' bf16
    experts path), as our custom op with the same contract."""
    if offs is None or bias is not None or out_dtype not in (None, x.dtype) or x.dim() != 2 or weight.dim() != 3:
        raise NotImplementedError("only the 2D x 3D form with offsets is decomposed")
    return torch.ops.mlx_delegate.grouped_mm(x, weight, offs)


TABLE: dict[Any, Callable[..., torch.Tensor]] = {aten.histc.default: histc, aten._grouped_mm.default: grouped_mm}


def apply(ep: ExportedProgram) -> ExportedProgram:
    """`ep` with the ops in TABLE decomposed (`ep` itself when it has none: no re-trace)."""
    present = {n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"}
    table = {op: fn for op, fn in TABLE.items() if op in present}
    return ep.run_decompositions(table) if table else ep
