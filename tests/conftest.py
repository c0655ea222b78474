import os

import pytest
import torch

import mlx_delegate  # noqa: F401  (first, so MLX's CPU BLAS route is installed before mlx loads)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # keep xdist workers from oversubscribing the 2 cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def compile_on():
    """Compiled graphs on for one test, whatever MLX_DELEGATE_COMPILE says."""
    from mlx_delegate import _runtime

    was = _runtime.compile_enabled()
    _runtime.set_compile(True)
    yield
    _runtime.set_compile(was)
