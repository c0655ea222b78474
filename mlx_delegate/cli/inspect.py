"""`mlx-delegate inspect FILE.pte`: what a program runs on MLX and what falls back to ExecuTorch."""

from __future__ import annotations

import argparse

from ..inspect import InspectError, format_summary, format_text, inspect_pte
from ._common import CLIError, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="summarize a .pte: delegate segments, IR nodes, fallback ops",
                              description=__doc__)
    p.add_argument("pte", help="path to an ExecuTorch program (.pte)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--summary", action="store_true", help="totals per method instead of per segment")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        info = inspect_pte(args.pte)
    except InspectError as e:
        raise CLIError(str(e)) from e
    if args.json:
        print_json(info.to_dict())
    else:
        print(format_summary(info) if args.summary else format_text(info))
    return 0
