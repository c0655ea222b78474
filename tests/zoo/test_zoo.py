"""Every zoo model, exported as its users export it, lowers whole through
`MLXPartitioner`, runs in the stock `executorch.runtime` and matches eager
PyTorch at each run size, compiled and with the CPU kernels off (see
`runner.check`)."""

from __future__ import annotations

import pytest
import torch

from .catalog import MODELS, ZooModel
from .runner import check

# Rows whose standard export does not lower yet, with the issue that tracks them. strict: the
# day they lower, the test fails until the row is promoted.
KNOWN_GAPS = {
    "mixtral": "issue 18: transformers' default grouped_mm experts (histc, grouped_mm_fallback)",
    "qwen3-moe": "issue 18: transformers' default grouped_mm experts (histc, grouped_mm_fallback)",
}


def _params() -> list:
    out = []
    for model in MODELS:
        for dtype in model.dtypes:
            marks = [pytest.mark.slow]
            if model.name in KNOWN_GAPS:
                marks.append(pytest.mark.xfail(reason=KNOWN_GAPS[model.name], strict=True))
            out.append(pytest.param(model, dtype, id=f"{model.name}-{str(dtype).removeprefix('torch.')}",
                                    marks=marks))
    return out


@pytest.mark.parametrize("model, dtype", _params())
def test_zoo_model(model: ZooModel, dtype: torch.dtype) -> None:
    result = check(model, dtype)
    assert result.segments == model.segments
