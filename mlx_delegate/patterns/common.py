"""Helpers shared by the pattern passes: op tests on Edge nodes, constant
lookup, and replacing a matched subgraph by one fused node only when that node
will be delegated."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from executorch.backends.transforms.utils import delete_constant_placeholder
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..builder import ProgramBuilder
from ..errors import Unsupported
from ..registry import canonical

aten = torch.ops.aten
TO_COPY = (aten._to_copy.default, torch.ops.dim_order_ops._to_dim_order_copy.default)
UNSQUEEZES = (aten.unsqueeze.default, aten.unsqueeze_copy.default)


def is_op(n: Any, *targets: Any) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and canonical(n.target) in targets


def val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def dtype(n: Any) -> torch.dtype | None:
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def shape(n: Any) -> list[Any]:
    v = val(n)
    return list(v.shape) if isinstance(v, torch.Tensor) else []


def same_size(a: Any, b: Any) -> bool:
    """Provably equal sizes (ints or SymInts), without adding guards."""
    if isinstance(a, torch.SymInt) and a.node.is_constant():
        a = int(a)
    if isinstance(b, torch.SymInt) and b.node.is_constant():
        b = int(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def same_shape(a: Any, b: Any) -> bool:
    sa, sb = shape(a), shape(b)
    return len(sa) == len(sb) and all(same_size(x, y) for x, y in zip(sa, sb))


def skip_casts(n: Any) -> Any:
    """`n` with dtype-only copies (to_copy / to_dim_order_copy) looked through."""
    while is_op(n, *TO_COPY) and n.args:
        n = n.args[0]
    return n


def only_user(n: torch.fx.Node, user: torch.fx.Node) -> bool:
    return list(n.users) == [user]


def constant_value(ep: ExportedProgram, n: Any) -> torch.Tensor | None:
    """The tensor behind a parameter / buffer / constant placeholder (through casts)."""
    n = skip_casts(n)
    if not isinstance(n, torch.fx.Node) or n.op != "placeholder":
        return None
    for spec in ep.graph_signature.input_specs:
        if spec.arg.name == n.name and spec.kind in (InputKind.PARAMETER, InputKind.BUFFER,
                                                     InputKind.CONSTANT_TENSOR):
            t = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            return t.detach() if isinstance(t, torch.Tensor) else None
    return None


def scalar_value(ep: ExportedProgram, n: Any) -> float | None:
    """A Python number, or the value of a one-element constant tensor."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return float(n)
    t = constant_value(ep, n)
    return float(t.reshape(-1)[0]) if t is not None and t.numel() == 1 else None


def fusable(n: torch.fx.Node) -> bool:
    """Whether the delegate lowers `n` (its handler's dry run passes)."""
    try:
        ProgramBuilder(check_only=True).lower_node(n)
    except Unsupported:
        return False
    return True


def replace(ep: ExportedProgram, old: torch.fx.Node, target: Any, args: tuple,
            kwargs: dict[str, Any] | None = None) -> bool:
    """Put `target(*args, **kwargs)` in place of `old` if the delegate will lower it; True when done."""
    with ep.graph.inserting_before(old):
        new = ep.graph.call_function(target, args, kwargs)
    new.meta = {**old.meta, "val": old.meta["val"]}
    if not fusable(new):
        ep.graph.erase_node(new)
        return False
    old.replace_all_uses_with(new)
    for spec in ep.graph_signature.output_specs:  # outputs are named after their nodes
        if getattr(spec.arg, "name", None) == old.name:
            spec.arg.name = new.name
    return True


def erase_dead(graph: torch.fx.Graph, roots: Iterable[torch.fx.Node]) -> None:
    """Remove `roots` and their producers once nothing reads them."""
    stack, erased = list(roots), set()
    while stack:
        n = stack.pop()
        if n in erased or n.op != "call_function" or n.users:
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


def constant_anchor(ep: ExportedProgram) -> torch.fx.Node:
    """Where new constant placeholders go: before the first user input (constants come first)."""
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    first_input = next((n for n, spec in zip(placeholders, ep.graph_signature.input_specs)
                        if spec.kind == InputKind.USER_INPUT), None)
    return first_input or next(n for n in ep.graph.nodes if n.op != "placeholder")


def drop_unused_constants(ep: ExportedProgram, nodes: Iterable[Any]) -> None:
    """Delete constant placeholders nothing reads any more (keeping state another input still names)."""
    for n in nodes:
        if not isinstance(n, torch.fx.Node) or n.op != "placeholder" or n.users:
            continue
        specs = ep.graph_signature.input_specs
        target = next((s.target for s in specs if s.arg.name == n.name), None)
        if sum(s.target == target for s in specs) == 1:
            delete_constant_placeholder(ep, n)
