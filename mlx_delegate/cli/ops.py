"""`mlx-delegate ops`: the op support table, generated from the handler registry."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import support_table
from ._common import CLIError, print_json, progress


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ops", help="list supported ops (writes docs/ops.md with --write)",
                              description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", nargs="?", const=support_table.DOC_PATH, type=Path, metavar="PATH",
                      help=f"write the markdown table (default {support_table.DOC_PATH})")
    mode.add_argument("--check", nargs="?", const=support_table.DOC_PATH, type=Path, metavar="PATH",
                      help="fail when the table at PATH is stale")
    mode.add_argument("--json", action="store_true", help="machine-readable rows")
    p.set_defaults(func=run)


def _check_doc_dir(path: Path) -> None:
    # Outside a source checkout the default path would land inside site-packages.
    if path == support_table.DOC_PATH and not path.parent.is_dir():
        raise CLIError(f"{path.parent} does not exist (not a source checkout?); pass a PATH")


def run(args: argparse.Namespace) -> int:
    if args.write:
        _check_doc_dir(args.write)
        progress(f"wrote {support_table.write(args.write)}")
        return 0
    if args.check:
        if support_table.is_fresh(args.check):
            return 0
        raise CLIError(f"{args.check} is stale; run `{support_table.REGENERATE}`")
    if args.json:
        print_json([r.to_dict() for r in support_table.support_rows()])
    else:
        print(support_table.render_markdown(), end="")
    return 0
