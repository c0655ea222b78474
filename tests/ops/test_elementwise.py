import pytest
import torch

from mlx_delegate.testing import FLOATS, cases, lower_and_compare


def randn(*shape):
    return lambda: (torch.randn(*shape),)


def positive(*shape):
    return lambda: (torch.rand(*shape) + 0.1,)


def two(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


CASES = [
    *cases("exp", torch.exp, randn(3, 4), FLOATS),
    *cases("add", torch.add, two((3, 4), (4,)), FLOATS),
    *cases("add_alpha", lambda x, y: torch.add(x, y, alpha=2.5), two((3, 4), (3, 4)), FLOATS),
    *cases("mul_scalar", lambda x: x * 3, randn(5), FLOATS),
    *cases("log", torch.log, positive(2, 3), FLOATS),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_elementwise(case):
    lower_and_compare(case)
