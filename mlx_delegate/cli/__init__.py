"""The `mlx-delegate` command line (also `python -m mlx_delegate`).

Subcommands are discovered: every public module in this package that defines
`register(subparsers)` adds one. `register` creates its parser and sets
`func=run`, where `run(args) -> int` returns the exit status. Modules whose
name starts with `_` hold shared helpers and are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import pkgutil
import sys
import warnings
from typing import Iterator, Sequence

from .. import _quiet, progress
from ._common import CLIError


def _subcommand_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-delegate", description="Run exported PyTorch programs on MLX.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show library warnings and log messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _subcommand_modules():
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError as e:  # e.g. an optional dependency: keep the other subcommands usable
            _register_unavailable(sub, name, e)
            continue
        register = getattr(module, "register", None)
        if callable(register):
            register(sub)
    return parser


def _register_unavailable(sub: argparse._SubParsersAction, name: str, error: ImportError) -> None:
    def fail(args: argparse.Namespace) -> int:
        raise CLIError(f"unavailable: {error}")

    p = sub.add_parser(name, help=f"(unavailable: {error})", add_help=False)
    p.set_defaults(func=fail, accepts_extra=True)  # whatever was passed, report why it cannot run


@contextlib.contextmanager
def _library_output(verbose: bool) -> Iterator[None]:
    """Export and lowering warn loudly about things users cannot act on: keep them behind -v.

    Restores the previous state, so `main()` can be called in-process (tests).
    """
    root = logging.getLogger()
    level = root.level
    # Stage progress of long lowering work is shown whatever the verbosity.
    shown = logging.StreamHandler(sys.stderr)
    shown.setFormatter(logging.Formatter("[mlx-delegate] %(message)s"))
    stages = progress.log
    stages.addHandler(shown)
    stages.setLevel(logging.INFO)
    stages.propagate = False
    with warnings.catch_warnings():
        if verbose:
            logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
            root.setLevel(logging.INFO)
            _quiet.show()  # what `import mlx_delegate` held back, and no filtering from here on
        else:
            warnings.simplefilter("ignore")
            root.setLevel(logging.ERROR)
        try:
            yield
        finally:
            root.setLevel(level)
            stages.removeHandler(shown)
            stages.setLevel(logging.NOTSET)
            stages.propagate = True
            if verbose:
                _quiet.install()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with _library_output(args.verbose):
            return int(args.func(args) or 0)
    except CLIError as e:
        print(f"mlx-delegate {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
