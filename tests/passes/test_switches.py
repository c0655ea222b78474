"""`MLXPartitioner(disable=...)` accepts every optimisation name and rejects typos up front."""

import pytest

from mlx_delegate import MLXPartitioner
from mlx_delegate.partitioner import SWITCHES


def test_every_switch_is_accepted():
    assert {"cse", "early_release", "fusions", "fuse_attention"} <= set(SWITCHES)
    MLXPartitioner(disable=SWITCHES)


def test_unknown_switch_is_named():
    with pytest.raises(ValueError, match=r"unknown optimisations \['fuse_attn'\].*fuse_attention"):
        MLXPartitioner(disable={"fuse_attn"})
