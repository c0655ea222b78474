"""Helpers shared by subcommands (not a subcommand: the name starts with `_`)."""

from __future__ import annotations

import json
import sys
from typing import Any


class CLIError(Exception):
    """A user-facing failure: printed as one line, no traceback."""


def progress(message: str) -> None:
    """A progress line for slow steps, on stderr so stdout stays parseable."""
    print(f"[mlx-delegate] {message}", file=sys.stderr, flush=True)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))
