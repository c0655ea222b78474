"""`import mlx_delegate` and the CLI print no third-party noise; `--verbose` shows it again."""

import os
import subprocess
import sys

NOISE = ("Failed to load", "is an Enum subclass", "FutureWarning")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_import_and_lowering_are_quiet():
    code = (
        "import torch, mlx_delegate\n"
        "from executorch.exir import to_edge_transform_and_lower\n"
        "ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))\n"
        "to_edge_transform_and_lower(ep, partitioner=[mlx_delegate.MLXPartitioner()]).to_executorch()\n"
        "print('done')\n"
    )
    r = _run("-c", code, env={"MLX_DELEGATE_VERBOSE": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done"
    assert not any(word in r.stderr for word in NOISE), r.stderr


def test_other_messages_of_those_loggers_pass():
    code = (
        "import logging, mlx_delegate\n"
        "from mlx_delegate import _quiet\n"
        "logging.getLogger('torchao').warning('something else')\n"
        "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_foo.so: nope')\n"
        "print(len(_quiet.held()) >= 1)\n"
    )
    r = _run("-c", code, env={"MLX_DELEGATE_VERBOSE": ""})
    assert r.returncode == 0, r.stderr
    assert "something else" in r.stderr
    assert "_C_foo" not in r.stderr
    assert r.stdout.strip() == "True"


def test_verbose_shows_what_was_held_back():
    code = (
        "import logging, sys, mlx_delegate\n"
        "from mlx_delegate import _quiet\n"
        "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_foo.so: nope')\n"
        "_quiet.show()\n"
        "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_bar.so: nope')\n"
    )
    r = _run("-c", code, env={"MLX_DELEGATE_VERBOSE": ""})
    assert r.returncode == 0, r.stderr
    assert "_C_foo" in r.stderr and "_C_bar" in r.stderr


def test_cli_ops_is_quiet():
    r = _run("-m", "mlx_delegate", "ops", env={"MLX_DELEGATE_VERBOSE": ""})
    assert r.returncode == 0, r.stderr
    assert "Supported ops" in r.stdout
    assert r.stderr == "", r.stderr
