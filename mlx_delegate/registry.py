"""The per-op handler registry.

A handler lowers one fx node into IR nodes through a `ProgramBuilder`. The same
handler decides support: the partitioner runs it in check mode, and a node is
supported exactly when its handler does not raise `Unsupported`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from executorch.exir.dialects.edge._ops import EdgeOpOverload

if TYPE_CHECKING:
    from .builder import ProgramBuilder

Handler = Callable[["ProgramBuilder", torch.fx.Node], None]

_HANDLERS: dict[Any, Handler] = {}


def canonical(target: Any) -> Any:
    """Map an Edge dialect op to the ATen op it wraps; other targets are returned as is."""
    if isinstance(target, EdgeOpOverload):
        return target._op
    return target


def register(*targets: Any) -> Callable[[Handler], Handler]:
    """Register a handler for one or more targets (ATen ops, operator functions). An op of a
    library that may not be loaded yet is named as a string, `"namespace.op.overload"`."""

    def wrap(fn: Handler) -> Handler:
        for t in targets:
            key = canonical(t)
            if key in _HANDLERS:
                raise ValueError(f"{key} already has a handler ({_HANDLERS[key].__qualname__})")
            _HANDLERS[key] = fn
        return fn

    return wrap


def lookup(target: Any) -> Handler | None:
    t = canonical(target)
    handler = _HANDLERS.get(t)
    if handler is None and isinstance(t, torch._ops.OpOverload):
        handler = _HANDLERS.get(target_name(t))
    return handler


def registered_targets() -> list[Any]:
    return list(_HANDLERS)


def target_name(target: Any) -> str:
    t = canonical(target)
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", str(t))


def base_name(target: Any) -> str:
    """The op's name without namespace or overload: `aten.add.Tensor` -> `add`."""
    t = canonical(target)
    if isinstance(t, str):
        return t.split(".")[1]
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))
