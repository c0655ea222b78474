"""docs/models.md must list every zoo row with what the catalog says about it."""

from .catalog import MODELS
from .report import DOC_PATH, REGENERATE, parse_static, static_cells


def test_docs_models_md_is_fresh():
    assert DOC_PATH.is_file(), f"docs/models.md is missing: run `{REGENERATE}`"
    assert parse_static(DOC_PATH.read_text()) == [static_cells(m) for m in MODELS], (
        f"docs/models.md is stale (zoo rows were added or changed): run `{REGENERATE}` and commit it")


def test_parse_reads_back_rendered_cells():
    from .report import render

    cells = static_cells(MODELS[0])
    assert parse_static(render([cells + ["1e-7", "yes", "1.0", "2.0"]])) == [cells]
