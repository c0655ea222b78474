"""Hold back the third-party noise that importing and using mlx_delegate triggers.

None of these messages is something our user can act on, and each would
otherwise print on every run:

- `executorch.exir` imports torchao, whose `__init__` logs (logger `torchao`)
  "Failed to load .../torchao/_C_*.so" for each CUDA kernel library its wheel
  ships, when torch is a CPU build.
- torchao registers an Enum with torch's pytree, which logs a deprecation
  (logger `torch.utils._pytree`, "... is an Enum subclass and is now natively
  supported ...").
- Lowering calls torch's `run_decompositions`, whose deep copy of a pytree
  `LeafSpec` emits a FutureWarning ("`isinstance(treespec, LeafSpec)` is
  deprecated").

Each filter matches one logger (or warning category) and one message, so
everything else those libraries say still gets through. `install()` runs first
thing on `import mlx_delegate`. Set `MLX_DELEGATE_VERBOSE=1` to skip it, or
call `show()` (the CLI's `--verbose` does): it removes the filters and
re-emits the log records held back so far.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# logger name -> message pattern (searched in the formatted message)
_LOG_RULES = {
    "torchao": re.compile(r"^Failed to load \S*torchao\S*_C_\w+"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
}
# (category, message regex as warnings.filterwarnings takes it: matched at the start)
_WARNING_RULES = [(FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated")]
_MAX_HELD = 100

_held: list[logging.LogRecord] = []
_installed: list[tuple[str, logging.Filter]] = []


class _Hold(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pattern.search(record.getMessage()):
            if len(_held) < _MAX_HELD:
                _held.append(record)
            return False
        return True


def install() -> None:
    """Add the filters (once; a no-op when MLX_DELEGATE_VERBOSE is set)."""
    if _installed or os.environ.get("MLX_DELEGATE_VERBOSE", "") not in ("", "0"):
        return
    for name, pattern in _LOG_RULES.items():
        f = _Hold(pattern)
        logging.getLogger(name).addFilter(f)
        _installed.append((name, f))
    for category, message in _WARNING_RULES:
        warnings.filterwarnings("ignore", message=message, category=category)


def show() -> None:
    """Remove the filters and re-emit the log records they held back."""
    for name, f in _installed:
        logging.getLogger(name).removeFilter(f)
    _installed.clear()
    for category, message in _WARNING_RULES:  # ahead of our "ignore": Python's default action again
        warnings.filterwarnings("default", message=message, category=category)
    held = list(_held)
    _held.clear()
    for record in held:
        logging.getLogger(record.name).handle(record)


def held() -> list[logging.LogRecord]:
    """The log records held back so far (for tests and `--verbose`)."""
    return list(_held)
