"""IR passes run after lowering (each in its own module, on by default, switchable off)."""

from __future__ import annotations

from typing import Any


def run_passes(built: Any, specs: dict[str, bytes]) -> None:
    """Run the enabled passes over a built program in place."""
    return None
