"""Loaded by scripts/sanitize.sh (via PYTHONPATH): makes `mlx_delegate._runtime`
the sanitized build named by MLXD_RUNTIME_OVERRIDE instead of the installed one."""

import importlib.machinery
import importlib.util
import os
import sys

_PATH = os.environ.get("MLXD_RUNTIME_OVERRIDE")


class _Override:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "mlx_delegate._runtime" or not _PATH:
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, _PATH)
        return importlib.util.spec_from_file_location(name, _PATH, loader=loader)


if _PATH:
    sys.meta_path.insert(0, _Override())
