"""The op support table (docs/ops.md), generated from the handler registry.

Every registered target is listed with its family (the `mlx_delegate.ops`
module holding its handler) and its known limits (the first line of the
handler's docstring). `tests/test_support_table.py` fails when docs/ops.md
is stale; `python -m mlx_delegate ops --write` regenerates it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import ops  # noqa: F401  (registers every handler)
from . import registry

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "ops.md"
REGENERATE = "python -m mlx_delegate ops --write"


@dataclass(frozen=True)
class SupportRow:
    target: str
    family: str  # last component of the handler's module
    module: str
    limits: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def target_label(target: Any) -> str:
    """`aten.add.Tensor` for ATen ops; `module.name` for Python callables (`operator.add`)."""
    if isinstance(registry.canonical(target), (torch._ops.OpOverload, str)):
        return registry.target_name(target)
    module = (getattr(target, "__module__", None) or "").lstrip("_")
    name = registry.target_name(target)
    return f"{module}.{name}" if module else name


def _first_doc_line(fn: Any) -> str:
    doc = (getattr(fn, "__doc__", None) or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


def support_rows() -> list[SupportRow]:
    """One row per registered target, sorted by family then target."""
    rows = []
    for t in registry.registered_targets():
        handler = registry.lookup(t)
        module = getattr(handler, "__module__", None) or "?"
        rows.append(SupportRow(target_label(t), module.rsplit(".", 1)[-1], module, _first_doc_line(handler)))
    return sorted(rows, key=lambda r: (r.family, r.target))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(rows: list[SupportRow] | None = None) -> str:
    """The full text of docs/ops.md."""
    rows = support_rows() if rows is None else rows
    by_family: dict[str, list[SupportRow]] = defaultdict(list)
    for r in rows:
        by_family[r.family].append(r)
    out = ["# Supported ops", "",
           f"Generated from the handler registry by `{REGENERATE}`; do not edit by hand.",
           "Targets not listed here stay on ExecuTorch's CPU kernels. A listed target can still be",
           "refused for particular arguments or dtypes (see Limits); such nodes stay on ExecuTorch too.",
           "", f"{len(rows)} targets in {len(by_family)} families:", ""]
    out += [f"- [{family}](#{family}) ({len(fam_rows)})" for family, fam_rows in by_family.items()]
    for family, fam_rows in by_family.items():
        out += ["", f"## {family}", "", f"Handlers in `{fam_rows[0].module}`.", "",
                "| Target | Limits |", "| --- | --- |"]
        out += [f"| `{r.target}` | {_cell(r.limits)} |" for r in fam_rows]
    return "\n".join(out) + "\n"


def write(path: Path = DOC_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown())
    return path


def is_fresh(path: Path = DOC_PATH) -> bool:
    return path.is_file() and path.read_text() == render_markdown()
