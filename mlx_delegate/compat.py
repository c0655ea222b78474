"""Fixes for bugs in the pinned ExecuTorch that break standard models before any
partitioner can act. Each is narrow, checked against the installed version's
behaviour, and applied once when `mlx_delegate` is imported.
"""

from __future__ import annotations

from typing import Any

import torch


def _list_return_validation() -> None:
    """ExecuTorch's edge verifier (`EdgeOpArgValidator.call_function`) iterates a node's
    results one level too deep when the op returns a single `Tensor[]` (split,
    split_with_sizes, unbind): it calls `len()` on the first tensor instead of on the list.
    When that tensor's first dimension is dynamic, `len()` turns it into the example's
    size, and the whole program is silently specialised to it (GPT-2's qkv `split` with a
    dynamic batch, `nn.GRU`): the exported range [1, 8] becomes [2, 2]. Handing the
    verifier the list wrapped once more makes it see what the schema says: one list."""
    from executorch.exir.verification import arg_validator

    cls = arg_validator.EdgeOpArgValidator
    original = cls.call_function
    if getattr(original, "_mlx_delegate_fixed", False):
        return

    def call_function(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
        val = self.node.meta.get("val")
        returns = getattr(getattr(target, "_schema", None), "returns", ())
        if len(returns) == 1 and returns[0].type == torch.ListType.ofTensors() and isinstance(val, (list, tuple)):
            self.node.meta["val"] = [val]
            try:
                return original(self, target, args, kwargs)
            finally:
                self.node.meta["val"] = val
        return original(self, target, args, kwargs)

    call_function._mlx_delegate_fixed = True  # type: ignore[attr-defined]
    cls.call_function = call_function


def apply() -> None:
    _list_return_validation()
