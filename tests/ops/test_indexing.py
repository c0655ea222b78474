"""Parity tests for gathers: embedding, index_select, gather, index.Tensor, take."""

import pytest
import torch
from torch.export import Dim

from mlx_delegate.partitioner import MLXPartitioner
from mlx_delegate.testing import FLOATS, Lambda, cases, dyn, lower, lower_and_compare, typed

F32 = (torch.float32,)
INTS = (torch.int32, torch.int64)
BYTES = (torch.int8, torch.uint8)
aten = torch.ops.aten


def data(*shape, dtype=torch.float32):
    """A test tensor of `dtype` (ints and bools are small so that they stay exact)."""
    if dtype == torch.bool:
        return torch.rand(*shape) > 0.5
    if not dtype.is_floating_point:
        low = 0 if dtype == torch.uint8 else -50
        return torch.randint(low, 50, shape, dtype=dtype)
    return torch.randn(*shape, dtype=dtype)


def idx(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


def rows(n, high, dtype=torch.int64):
    """`n` random indices in [0, high) (duplicates allowed)."""
    return torch.randint(0, high, (n,), dtype=dtype)


N = Dim("n", min=2, max=32)
R = Dim("r", min=2, max=32)

EMBEDDING = [
    *cases("embedding", lambda w, i: torch.nn.functional.embedding(i, w),
           lambda: (data(10, 4), idx([[0, 3, 9], [2, 2, 5]])), FLOATS),
    *cases("embedding_i32", lambda w, i: torch.nn.functional.embedding(i, w),
           lambda: (data(10, 4), idx([1, 0, 7], torch.int32)), F32),
    *cases("embedding_padding_idx", lambda w, i: torch.nn.functional.embedding(i, w, padding_idx=2),
           lambda: (data(6, 3), idx([2, 1, 2, 0])), F32),
    *cases("embedding_0d", lambda w, i: torch.nn.functional.embedding(i, w), lambda: (data(6, 3), idx(4)), F32),
    *cases("embedding_empty", lambda w, i: torch.nn.functional.embedding(i, w),
           lambda: (data(6, 3), idx([], torch.int64)), F32),
    *cases("embedding_module", lambda: torch.nn.Embedding(12, 8), lambda: (idx([[1, 11], [0, 5]]),), FLOATS,
           is_module=True),
    *cases("embedding_dynamic", lambda w, i: torch.nn.functional.embedding(i, w),
           lambda: (data(10, 4), rows(5, 10)), F32, dynamic_shapes=dyn(None, {0: N}),
           more_inputs=lambda: [(data(10, 4), rows(2, 10)), (data(10, 4), rows(17, 10))]),
    *cases("embedding_large", lambda w, i: torch.nn.functional.embedding(i, w),
           lambda: (data(1000, 64), torch.randint(0, 1000, (4, 16))), FLOATS),
    *typed("embedding", lambda w, i: torch.nn.functional.embedding(i, w),
           lambda dt: (data(7, 3, dtype=dt), idx([6, 0, 3]))),
]

INDEX_SELECT = [
    *cases("index_select_dim0", lambda x, i: torch.index_select(x, 0, i), lambda: (data(5, 4), idx([4, 0, 2])),
           FLOATS),
    *cases("index_select_dim1", lambda x, i: torch.index_select(x, 1, i), lambda: (data(3, 6, 2), idx([5, 1])),
           FLOATS),
    *cases("index_select_neg_dim", lambda x, i: torch.index_select(x, -1, i), lambda: (data(3, 6), idx([5, 5, 1])),
           F32),
    *cases("index_select_0d", lambda x, i: torch.index_select(x, 1, i), lambda: (data(3, 6), idx(2)), F32),
    *cases("index_select_i32", lambda x, i: torch.index_select(x, 0, i),
           lambda: (data(5, 2), idx([1, 3], torch.int32)), F32),
    *cases("index_select_noncontig", lambda x, i: torch.index_select(x.transpose(0, 1), 0, i),
           lambda: (data(4, 6), idx([5, 0, 3])), FLOATS),
    *cases("index_select_empty", lambda x, i: torch.index_select(x, 0, i), lambda: (data(5, 3), idx([])), F32),
    *cases("index_select_zero_rows", lambda x, i: torch.index_select(x, 1, i),
           lambda: (data(0, 3), idx([2, 0])), F32),
    *cases("index_select_dynamic_index", lambda x, i: torch.index_select(x, 0, i),
           lambda: (data(8, 3), rows(4, 8)), F32, dynamic_shapes=dyn(None, {0: N}),
           more_inputs=lambda: [(data(8, 3), rows(2, 8)), (data(8, 3), rows(20, 8))]),
    *cases("index_select_dynamic_input", lambda x, i: torch.index_select(x, 1, i),
           lambda: (data(4, 6), idx([5, 1])), F32, dynamic_shapes=dyn({0: R}, None),
           more_inputs=lambda: [(data(2, 6), idx([0, 3])), (data(19, 6), idx([2, 2]))]),
    *typed("index_select", lambda x, i: torch.index_select(x, 1, i), lambda dt: (data(3, 5, dtype=dt), idx([4, 0])),
           (*INTS, torch.bool, *BYTES)),
]

GATHER = [
    *cases("gather_dim1", lambda x, i: torch.gather(x, 1, i),
           lambda: (data(3, 5), idx([[0, 4], [1, 1], [3, 2]])), FLOATS),
    *cases("gather_dim0", lambda x, i: torch.gather(x, 0, i),
           lambda: (data(4, 3), idx([[3, 0, 1], [2, 2, 0]])), FLOATS),
    *cases("gather_smaller_index", lambda x, i: torch.gather(x, 1, i),
           lambda: (data(4, 5), idx([[4, 0, 1], [2, 3, 3]])), FLOATS),
    *cases("gather_unit_index_dims", lambda x, i: torch.gather(x, 0, i),
           lambda: (data(4, 5), idx([[3]])), F32),
    *cases("gather_3d_neg_dim", lambda x, i: torch.gather(x, -1, i),
           lambda: (data(2, 3, 4), torch.randint(0, 4, (2, 3, 6))), F32),
    *cases("gather_noncontig", lambda x, i: torch.gather(x.transpose(0, 1), 1, i),
           lambda: (data(5, 3), idx([[0, 4], [1, 1], [3, 2]])), FLOATS),
    *cases("gather_empty", lambda x, i: torch.gather(x, 1, i),
           lambda: (data(3, 5), torch.zeros(3, 0, dtype=torch.int64)), F32),
    *cases("gather_dynamic", lambda x, i: torch.gather(x, 1, i),
           lambda: (data(4, 6), torch.randint(0, 6, (4, 2))), F32, dynamic_shapes=dyn({0: R}, {0: R}),
           more_inputs=lambda: [(data(9, 6), torch.randint(0, 6, (9, 2)))]),
    *typed("gather", lambda x, i: torch.gather(x, 1, i),
           lambda dt: (data(3, 4, dtype=dt), idx([[3, 0], [1, 1], [2, 0]]))),
]

ADVANCED = [
    *cases("index_one", lambda x, i: x[i], lambda: (data(5, 3), idx([4, 0, 2, 2])), FLOATS),
    *cases("index_two_broadcast", lambda x, i, j: x[i, j],
           lambda: (data(5, 6), idx([[0], [4]]), idx([5, 1, 2])), FLOATS),
    *cases("index_skip_leading", lambda x, i: x[:, i], lambda: (data(3, 6, 2), idx([5, 0])), FLOATS),
    *cases("index_consecutive_middle", lambda x, i, j: x[:, i, j],
           lambda: (data(2, 4, 5, 3), idx([[3, 0], [1, 1]]), idx([4, 2])), FLOATS),
    *cases("index_split_axes", lambda x, i, j: x[i, :, j],
           lambda: (data(4, 3, 5), idx([3, 0, 1]), idx([4, 4, 0])), FLOATS),
    *cases("index_three_broadcast", lambda x, i, j, k: x[i, j, k],
           lambda: (data(4, 5, 6), idx([[[3]], [[0]]]), idx([[4], [1], [0]]), idx([5, 0, 2, 2])), F32),
    *cases("index_split_axes_2d", lambda x, i, j: x[:, i, :, j],
           lambda: (data(2, 4, 3, 5), idx([[3], [0]]), idx([4, 1, 0])), F32),
    *cases("index_negative", lambda x, i, j: x[i, j],
           lambda: (data(4, 5), idx([-1, 0, -4]), idx([-5, -1, 2])), FLOATS),
    *cases("index_negative_skip", lambda x, i: x[:, :, i], lambda: (data(2, 3, 4), idx([-1, -2])), F32),
    *cases("index_i32", lambda x, i: x[i], lambda: (data(5, 2), idx([1, -1], torch.int32)), F32),
    *cases("index_2d_index", lambda x, i: x[i], lambda: (data(6, 2), idx([[1, 5, 0], [2, 2, 3]])), F32),
    *cases("index_0d_index", lambda x, i: aten.index(x, [None, i]), lambda: (data(3, 4), idx(3)), F32),
    *cases("index_all_dims", lambda x, i, j, k: x[i, j, k],
           lambda: (data(2, 3, 4), idx([1, 0]), idx([2, 2]), idx([3, 0])), F32),
    *cases("index_ellipsis", lambda x, i: x[..., i], lambda: (data(2, 3, 4, 5), idx([4, 1])), F32),
    *cases("index_noncontig", lambda x, i: x.transpose(0, 1)[i], lambda: (data(3, 6), idx([5, 0, 5])), FLOATS),
    *cases("index_noncontig_two", lambda x, i, j: x.transpose(0, 1)[i, j],
           lambda: (data(3, 6), idx([5, 0]), idx([2, 1])), FLOATS),
    *cases("index_empty", lambda x, i: x[i], lambda: (data(5, 3), idx([], torch.int64)), F32),
    *cases("index_zero_size_dim", lambda x, i: x[:, i], lambda: (data(0, 4), idx([3, 1])), F32),
    *cases("index_unsafe", lambda x, i: aten._unsafe_index(x, [None, i]), lambda: (data(2, 5), idx([4, 0])), F32),
    *cases("index_dynamic_index", lambda x, i: x[i], lambda: (data(8, 3), rows(4, 8)), F32,
           dynamic_shapes=dyn(None, {0: N}), more_inputs=lambda: [(data(8, 3), rows(2, 8)), (data(8, 3), rows(30, 8))]),
    *cases("index_dynamic_input", lambda x, i: x[:, i], lambda: (data(4, 6), idx([5, -1])), F32,
           dynamic_shapes=dyn({0: R}, None), more_inputs=lambda: [(data(2, 6), idx([0, 3])), (data(13, 6), idx([2, 2]))]),
    *typed("index", lambda x, i, j: x[i, j], lambda dt: (data(4, 5, dtype=dt), idx([3, 0]), idx([[4], [1]])),
           (*INTS, torch.bool, *BYTES)),
]

TAKE = [
    *cases("take", torch.take, lambda: (data(3, 4), idx([11, 0, 5])), FLOATS),
    *cases("take_negative", torch.take, lambda: (data(3, 4), idx([-1, -12, 3])), F32),
    *cases("take_2d_index", torch.take, lambda: (data(2, 5), idx([[9, 0], [1, 1]])), F32),
    *cases("take_noncontig", lambda x, i: torch.take(x.transpose(0, 1), i), lambda: (data(3, 4), idx([1, 4, 11])),
           F32),
    *cases("take_empty_input", torch.take, lambda: (data(0, 3), idx([], torch.int64)), F32),
    *cases("take_dynamic", torch.take, lambda: (data(4, 3), idx([11, -1])), F32, dynamic_shapes=dyn({0: R}, None),
           more_inputs=lambda: [(data(n, 3), idx([5, -n * 3])) for n in (2, 7)]),
    *typed("take", torch.take, lambda dt: (data(2, 3, dtype=dt), idx([5, 0])), INTS),
]

CASES = EMBEDDING + INDEX_SELECT + GATHER + ADVANCED + TAKE


@pytest.mark.parametrize("case", CASES, ids=str)
def test_indexing(case):
    lower_and_compare(case)


def test_boolean_mask_index_is_refused():
    """x[mask] has a data-dependent size: it must stay on ExecuTorch (and still run there)."""
    partitioner = MLXPartitioner()
    x, mask = data(4, 3), idx([True, False, True, True], torch.bool)
    lowered = lower(Lambda(lambda x, m: x[m] * 2), (x, mask), partitioner=partitioner)
    reasons = [r for r in partitioner.rejected.values() if "mask" in r]
    assert reasons, partitioner.rejected
    assert "index" in lowered.summary[1]
    torch.testing.assert_close(lowered.method().execute([x, mask])[0], x[mask] * 2)
