"""Per-call overhead: a 2-op graph, `(x + y) * y`, on 4-element fp32 tensors.

The work is negligible, so each figure is what one call through the engine
costs: for the delegate, the stock ExecuTorch runtime, our backend and one MLX
evaluation.

    python benchmarks/overhead.py [--quick] [--json out.json]
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from common import Workload, main

SIZE = 4


class AddMul(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) * y


def _mlx_add_mul() -> Callable[..., Any]:
    return lambda x, y: (x + y) * y


def workloads(quick: bool) -> Iterator[Workload]:
    torch.manual_seed(0)
    inputs = (torch.randn(SIZE), torch.randn(SIZE))
    yield Workload(f"overhead (x+y)*y [{SIZE}]", AddMul(), inputs, _mlx_add_mul)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], [workloads])
