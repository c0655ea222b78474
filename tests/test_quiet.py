"""`import mlx_delegate` and the CLI print no third-party noise; `--verbose` shows it again."""

import os
import subprocess
import sys

NOISE = ("Failed to load", "is an Enum subclass", "FutureWarning")


def _run(*args: str) -> subprocess.CompletedProcess:
    """A child Python with the default (quiet) output; it must succeed."""
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MLX_DELEGATE_VERBOSE": ""})
    assert r.returncode == 0, r.stderr
    return r


def _python(*lines: str) -> subprocess.CompletedProcess:
    return _run("-c", "\n".join(lines))


def test_import_and_lowering_are_quiet():
    r = _python("import torch, mlx_delegate",
                "from executorch.exir import to_edge_transform_and_lower",
                "ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))",
                "to_edge_transform_and_lower(ep, partitioner=[mlx_delegate.MLXPartitioner()]).to_executorch()",
                "print('done')")
    assert r.stdout.strip() == "done"
    assert not any(word in r.stderr for word in NOISE), r.stderr


def test_other_messages_of_those_loggers_pass():
    r = _python("import logging, mlx_delegate",
                "from mlx_delegate import _quiet",
                "logging.getLogger('torchao').warning('something else')",
                "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_foo.so: nope')",
                "print(len(_quiet.held()) >= 1)")
    assert "something else" in r.stderr
    assert "_C_foo" not in r.stderr
    assert r.stdout.strip() == "True"


def test_verbose_shows_what_was_held_back():
    r = _python("import logging, sys, mlx_delegate",
                "from mlx_delegate import _quiet",
                "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_foo.so: nope')",
                "_quiet.show()",
                "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_bar.so: nope')")
    assert "_C_foo" in r.stderr and "_C_bar" in r.stderr


def test_cli_ops_is_quiet():
    r = _run("-m", "mlx_delegate", "ops")
    assert "Supported ops" in r.stdout
    assert r.stderr == "", r.stderr
