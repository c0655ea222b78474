import os

import pytest
import torch

import mlx_delegate  # noqa: F401  (first, so MLX's CPU BLAS route is installed before mlx loads)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # keep xdist workers from oversubscribing the 2 cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["default", "compile-off", "kernels-off"])
def runtime_path(request):
    """Runs a model test on each runtime path (testing.RUNTIME_PATHS): as users run it (compiled
    graphs, CPU kernels), node by node, and with MLX's own primitives in place of the CPU kernels
    (what Metal and CUDA run). Load the program inside the test."""
    from mlx_delegate.testing import RUNTIME_PATHS, runtime_switches

    with runtime_switches(**RUNTIME_PATHS[request.param]):
        yield request.param


@pytest.fixture
def compile_on():
    """Compiled graphs on for one test, whatever MLX_DELEGATE_COMPILE says."""
    from mlx_delegate import _runtime

    was = _runtime.compile_enabled()
    _runtime.set_compile(True)
    yield
    _runtime.set_compile(was)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the files that hold `slow` tests first, each file kept whole.

    The suite runs on two xdist workers; a model-sized test collected last (the fresh-venv wheel test
    takes minutes) would leave the other worker idle for the tail. Files stay contiguous so their
    module-scoped fixtures are built once per worker."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.path not in slow_files, order[item.nodeid]))
