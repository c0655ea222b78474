"""Graph passes run by `MLXDelegateBackend.preprocess` on each delegated graph.

Every pass is on by default; `MLXPartitioner(disable={"cse"})` turns one off
for debugging.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import cse

GRAPH_PASSES: dict[str, Callable[[torch.fx.Graph], int]] = {"cse": cse.run}
# Switches handled by the builder and runtime rather than by a graph pass.
RUNTIME_SWITCHES = {"early_release": "free each intermediate after its last use (runtime)"}


def run_graph_passes(graph: torch.fx.Graph, disabled: frozenset[str] = frozenset()) -> dict[str, int]:
    """Run the enabled passes in order; returns the number of changes each made."""
    unknown = disabled - GRAPH_PASSES.keys() - RUNTIME_SWITCHES.keys()
    if unknown:
        raise ValueError(f"unknown passes {sorted(unknown)}; known: {sorted(GRAPH_PASSES | RUNTIME_SWITCHES)}")
    stats = {}
    for name, fn in GRAPH_PASSES.items():
        if name not in disabled:
            stats[name] = fn(graph)
    graph.lint()
    return stats
