"""Common subexpression elimination on the delegated graph.

Transformer exports repeat the same work per layer (mask construction, sym
sizes, casts of the same tensor); each distinct computation is kept once.
"""

from __future__ import annotations

from typing import Any

import torch


def _key(n: torch.fx.Node, canon: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    def freeze(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", canon.get(a, a))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(freeze(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, freeze(v)) for k, v in a.items())))
        if isinstance(a, float) and a != a:  # NaN never equals itself
            return ("nan",)
        return (type(a).__name__, a)

    return (n.target, freeze(n.args), freeze(n.kwargs))


def _pure(n: torch.fx.Node) -> bool:
    if n.op != "call_function" or n.is_impure():
        return False
    schema = getattr(getattr(n.target, "_op", n.target), "_schema", None)
    return schema is None or not schema.is_mutable


def run(graph: torch.fx.Graph) -> int:
    """Merge identical pure nodes in place; returns how many were removed."""
    seen: dict[Any, torch.fx.Node] = {}
    canon: dict[torch.fx.Node, torch.fx.Node] = {}
    removed = 0
    for n in list(graph.nodes):
        if not _pure(n):
            continue
        try:
            key = _key(n, canon)
            hash(key)
        except TypeError:
            continue  # an argument that cannot be compared safely
        if key in seen:
            n.replace_all_uses_with(seen[key])
            canon[n] = seen[key]
            graph.erase_node(n)
            removed += 1
        else:
            seen[key] = n
    return removed
