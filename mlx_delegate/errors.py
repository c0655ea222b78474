"""Exceptions raised by the AOT side."""


class Unsupported(Exception):
    """A handler cannot lower this node; the partitioner leaves it to ExecuTorch.

    The message starts with the op in brackets, e.g. ``[aten.add.Tensor] complex dtype``.
    """


class LoweringError(RuntimeError):
    """A node the partitioner tagged failed to lower (a bug: tagging and lowering share handlers)."""
