"""Lowering exported methods into one ExecuTorch program, with what stayed outside the delegate."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.export import ExportedProgram

from ..registry import base_name


@dataclass
class Lowering:
    buffer: bytes
    fallback: dict[str, list[str]]  # method -> ops left on ExecuTorch's CPU kernels
    segments: dict[str, int]  # method -> delegate calls


def delegate_summary(edge: Any, method: str = "forward") -> tuple[int, list[str]]:
    """(number of delegate calls, names of ops left outside the delegate) of one method of an
    edge program."""
    segments, leftover = 0, []
    for n in edge.exported_program(method).graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.executorch_call_delegate:
            segments += 1
        elif n.target is not operator.getitem:
            leftover.append(base_name(n.target))
    return segments, leftover


def lower_methods(programs: ExportedProgram | Mapping[str, ExportedProgram], partitioner: Any = None,
                  config: Any = None) -> Lowering:
    """Lower one exported program (method `forward`) or several named ones into one program
    (`MLXPartitioner` unless given another, e.g. XNNPACK's for comparison)."""
    from executorch.exir import to_edge_transform_and_lower

    from ..partitioner import MLXPartitioner

    named = dict(programs) if isinstance(programs, Mapping) else {"forward": programs}
    edge = to_edge_transform_and_lower(named, partitioner=[partitioner or MLXPartitioner()])
    fallback, segments = {}, {}
    for name in named:
        segments[name], fallback[name] = delegate_summary(edge, name)
    program = edge.to_executorch(config) if config is not None else edge.to_executorch()
    return Lowering(program.buffer, fallback, segments)
