"""Helpers for the delegate-side fusions: the nodes a match covers, whether
anything outside the match reads them, and evaluating small subgraphs with
torch (constant masks, element-wise probes)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.export import ExportedProgram

from .common import TO_COPY, aten, constant_value, is_op

# Element-wise ops an activation may be written with (scalars broadcast, nothing else).
ELEMENTWISE = (
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.neg.default,
    aten.erf.default, aten.tanh.default, aten.sigmoid.default, aten.exp.default, aten.reciprocal.default, aten.sqrt.default,
    aten.rsqrt.default, *TO_COPY,
)
MAX_EVAL_ELEMENTS = 1 << 20  # constant masks larger than this are not evaluated at lowering time


def closed(nodes: Iterable[torch.fx.Node], head: torch.fx.Node) -> bool:
    """Whether only `nodes` read the nodes of a match, except its `head` (so fusing drops them all)."""
    inside = set(nodes) | {head}
    return all(u in inside for n in inside if n is not head for u in n.users)


def scalar_constant(ep: ExportedProgram, a: Any) -> float | None:
    """A Python number or a one-element constant tensor (looked through casts), as a float."""
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return float(a)
    t = constant_value(ep, a)
    if t is None or t.numel() != 1 or t.dtype == torch.bool:
        return None
    return float(t.reshape(-1)[0])


def region(ep: ExportedProgram, head: torch.fx.Node, x: torch.fx.Node, ops: tuple,
           limit: int = 24) -> list[torch.fx.Node] | None:
    """The nodes computing `head` from `x` and scalar constants through `ops` only (x excluded),
    or None when `head` depends on anything else."""
    seen: list[torch.fx.Node] = []
    stack = [head]
    while stack:
        n = stack.pop()
        if n is x or n in seen:
            continue
        if not is_op(n, *ops) or len(seen) >= limit:
            return None
        seen.append(n)
        for a in n.all_input_nodes:
            if a is not x and scalar_constant(ep, a) is None:
                stack.append(a)
    return seen


def evaluate(ep: ExportedProgram, n: Any, env: dict[torch.fx.Node, torch.Tensor],
             casts_are_identity: bool = False, depth: int = 32) -> Any:
    """`n`'s value computed by torch from `env` and the program's constants; None when it
    depends on anything else (user inputs, symbolic sizes) or grows too large."""
    if not isinstance(n, torch.fx.Node):
        return n
    if n in env:
        return env[n]
    t = constant_value(ep, n)
    if t is not None:
        return t
    if n.op != "call_function" or depth == 0:
        return None
    if casts_are_identity and is_op(n, *TO_COPY):
        return evaluate(ep, n.args[0], env, casts_are_identity, depth - 1)
    missing = object()

    def value(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(value(b) for b in a)
        if isinstance(a, torch.fx.Node):
            v = evaluate(ep, a, env, casts_are_identity, depth - 1)
            return missing if v is None else v
        return None if isinstance(a, torch.SymInt) and not a.node.is_constant() else a

    args, kwargs = value(list(n.args)), {k: value(v) for k, v in n.kwargs.items()}
    flat = [*args, *kwargs.values()]
    if any(a is missing or isinstance(a, torch.SymInt) for a in flat) or any(
            isinstance(a, (list, tuple)) and any(b is missing for b in a) for a in flat):
        return None
    try:
        out = n.target(*args, **kwargs)
    except Exception:  # an op we cannot replay here: no constant value
        return None
    if not isinstance(out, torch.Tensor) or out.numel() > MAX_EVAL_ELEMENTS:
        return None
    env[n] = out
    return out


def matches_function(ep: ExportedProgram, head: torch.fx.Node, x: torch.fx.Node,
                     fn: Callable[[torch.Tensor], torch.Tensor], probe: torch.Tensor) -> bool:
    """Whether the element-wise subgraph from `x` to `head` computes `fn` on `probe` (float64)."""
    got = evaluate(ep, head, {x: probe}, casts_are_identity=True)
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return False
    want = fn(probe)
    return bool(torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6))
