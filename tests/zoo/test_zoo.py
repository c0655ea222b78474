"""Every zoo model, exported as its users export it, lowers whole through
`MLXPartitioner`, runs in the stock `executorch.runtime` and matches eager
PyTorch at each run size, compiled and with the CPU kernels off (see
`runner.check`)."""

from __future__ import annotations

import pytest
import torch

from .catalog import MODELS, ZooModel
from .runner import check


def _params() -> list:
    out = []
    for model in MODELS:
        for dtype in model.dtypes:
            marks = [pytest.mark.slow]
            if model.gap:
                # strict: the day the row lowers, this fails until the gap is removed from the row.
                marks.append(pytest.mark.xfail(reason=model.gap, strict=True))
            out.append(pytest.param(model, dtype, id=f"{model.name}-{str(dtype).removeprefix('torch.')}",
                                    marks=marks))
    return out


@pytest.mark.parametrize("model, dtype", _params())
def test_zoo_model(model: ZooModel, dtype: torch.dtype) -> None:
    result = check(model, dtype)
    assert result.segments == model.segments
