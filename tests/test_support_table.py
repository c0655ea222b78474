"""docs/ops.md must match the handler registry (regenerate with the command in the message)."""

from mlx_delegate import registry, support_table
from mlx_delegate.support_table import REGENERATE, SupportRow, render_markdown, support_rows


def test_docs_ops_md_is_fresh():
    assert support_table.DOC_PATH.is_file(), f"docs/ops.md is missing: run `{REGENERATE}`"
    assert support_table.DOC_PATH.read_text() == render_markdown(), (
        f"docs/ops.md is stale (handlers were added or changed): run `{REGENERATE}` and commit docs/ops.md")


def test_every_target_is_listed_once():
    rows = support_rows()
    assert len(rows) == len(registry.registered_targets())
    assert len({r.target for r in rows}) == len(rows)
    assert rows == sorted(rows, key=lambda r: (r.family, r.target))


def test_row_fields():
    exp = next(r for r in support_rows() if r.target == "aten.exp.default")
    assert (exp.family, exp.module) == ("elementwise", "mlx_delegate.ops.elementwise")
    assert support_table.target_label(__import__("operator").add) == "operator.add"


def test_limits_come_from_the_docstring():
    def handler(b, n):
        """Only contiguous inputs.

        More detail that stays out of the table.
        """
    assert support_table._first_doc_line(handler) == "Only contiguous inputs."
    assert support_table._first_doc_line(lambda b, n: None) == ""


def test_markdown_escapes_pipes():
    text = render_markdown([SupportRow("aten.x.default", "fam", "mlx_delegate.ops.fam", "a | b")])
    assert "| `aten.x.default` | a \\| b |" in text and "1 targets in 1 families" in text
