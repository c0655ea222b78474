"""Parity tests for scatters and writes: index_put, scatter*, index_copy/fill/add,
slice_scatter, select_scatter, masked_fill.

Set-style rows use distinct target positions: with duplicates torch leaves the
winner unspecified.
"""

import pytest
import torch
from torch.export import Dim

from mlx_delegate.partitioner import MLXPartitioner
from mlx_delegate.testing import FLOATS, Lambda, amend, cases, dyn, lower, lower_and_compare, typed

F32 = (torch.float32,)
INTS = (torch.int32, torch.int64)
aten = torch.ops.aten


def data(*shape, dtype=torch.float32):
    """A test tensor of `dtype` (ints and bools are small so that they stay exact)."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-20, 20, shape, dtype=dtype)
    return torch.randn(shape, dtype=dtype)


def idx(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


def distinct(shape, dim, size):
    """An index of `shape` whose entries along `dim` are distinct values in [0, size)."""
    full = list(shape)
    full[dim] = size
    return torch.rand(*full).argsort(dim).narrow(dim, 0, shape[dim]).contiguous()


N = Dim("n", min=2, max=32)
R = Dim("r", min=2, max=32)

INDEX_PUT = [
    *cases("index_put", lambda x, i, v: x.index_put((i,), v),
           lambda: (data(5, 3), idx([4, 0, 2]), data(3, 3)), FLOATS),
    *cases("index_put_accumulate", lambda x, i, v: x.index_put((i,), v, accumulate=True),
           lambda: (data(5, 3), idx([4, 0, 4, 4, 1]), data(5, 3)), FLOATS),
    *cases("index_put_two_broadcast", lambda x, i, j, v: x.index_put((i, j), v),
           lambda: (data(5, 6), idx([[0], [4]]), idx([5, 1, 2]), data(2, 3)), FLOATS),
    *cases("index_put_skip_leading", lambda x, i, v: aten.index_put(x, [None, i], v),
           lambda: (data(3, 6, 2), idx([5, 0]), data(3, 2, 2)), FLOATS),
    *cases("index_put_split_axes", lambda x, i, j, v: aten.index_put(x, [i, None, j], v),
           lambda: (data(4, 3, 5), idx([3, 0, 1]), idx([4, 4, 0]), data(3, 3)), FLOATS),
    *cases("index_put_consecutive_middle", lambda x, i, j, v: aten.index_put(x, [None, i, j], v),
           lambda: (data(2, 4, 5, 3), idx([3, 0]), idx([4, 2]), data(2, 2, 3)), F32),
    *cases("index_put_negative", lambda x, i, v: aten.index_put(x, [None, i], v),
           lambda: (data(3, 4), idx([-1, 0, -3]), data(3, 3)), F32),
    *cases("index_put_scalar_value", lambda x, i, v: x.index_put((i,), v),
           lambda: (data(5, 3), idx([4, 1]), data()), FLOATS),
    *cases("index_put_row_value", lambda x, i, v: x.index_put((i,), v),
           lambda: (data(5, 3), idx([4, 1]), data(3)), F32),
    *cases("index_put_accumulate_skip", lambda x, i, v: aten.index_put(x, [None, i], v, True),
           lambda: (data(2, 4), idx([1, 1, 3]), data(2, 3)), F32),
    *cases("index_put_setitem", lambda x, i, v: x.clone().index_put_((i,), v),
           lambda: (data(4, 2), idx([3, 1]), data(2, 2)), F32),
    *cases("index_put_noncontig", lambda x, i, v: x.transpose(0, 1).index_put((i,), v),
           lambda: (data(3, 5), idx([4, 0]), data(2, 3)), FLOATS),
    *cases("index_put_empty", lambda x, i, v: x.index_put((i,), v),
           lambda: (data(5, 3), idx([]), data(0, 3)), F32),
    *cases("index_put_unsafe", lambda x, i, v: aten._unsafe_index_put(x, [i], v),
           lambda: (data(5, 3), idx([2, 0]), data(2, 3)), F32),
    *cases("index_put_dynamic", lambda x, i, v: x.index_put((i,), v, accumulate=True),
           lambda: (data(6, 3), torch.randint(0, 6, (4,)), data(4, 3)), F32, dynamic_shapes=dyn(None, {0: N}, {0: N}),
           more_inputs=lambda: [(data(6, 3), torch.randint(0, 6, (n,)), data(n, 3)) for n in (2, 20)]),
    *cases("index_put_dynamic_input", lambda x, i, v: aten.index_put(x, [None, i], v),
           lambda: (data(4, 6), idx([5, 1]), data(4, 2)), F32, dynamic_shapes=dyn({0: R}, None, {0: R}),
           more_inputs=lambda: [(data(n, 6), idx([0, 3]), data(n, 2)) for n in (2, 11)]),
    *typed("index_put", lambda x, i, v: x.index_put((i,), v),
           lambda dt: (data(4, 3, dtype=dt), idx([3, 0]), data(2, 3, dtype=dt))),
    *typed("index_put_accumulate", lambda x, i, v: x.index_put((i,), v, accumulate=True),
           lambda dt: (data(4, 3, dtype=dt), idx([3, 3, 0]), data(3, 3, dtype=dt)), INTS),
]

MASK_PUT = [
    *cases("index_put_mask", lambda x, m, v: x.index_put((m,), v), lambda: (data(4, 3), data(4, 3) > 0, data()),
           FLOATS),
    *cases("index_put_mask_accumulate", lambda x, m, v: x.index_put((m,), v, accumulate=True),
           lambda: (data(4, 3), data(4, 3) > 0, data(1)), FLOATS),
    *cases("index_put_mask_leading_dims", lambda x, m, v: x.index_put((m,), v),
           lambda: (data(4, 3, 2), data(4) > 0, data()), F32),
    *cases("index_put_mask_after_skip", lambda x, m, v: aten.index_put(x, [None, m], v),
           lambda: (data(2, 5, 3), data(5) > 0, data()), F32),
    *cases("index_put_mask_dynamic", lambda x, m, v: x.index_put((m,), v),
           lambda: (data(4, 3), data(4, 3) > 0, data()), F32, dynamic_shapes=dyn({0: R}, {0: R}, None),
           more_inputs=lambda: [(data(n, 3), data(n, 3) > 0, data()) for n in (2, 9)]),
    *typed("index_put_mask", lambda x, m, v: x.index_put((m,), v),
           lambda dt: (data(3, 4, dtype=dt), data(3, 4) > 0, data(dtype=dt))),
]


def scatter_reduce(reduce, include_self):
    return lambda x, i, s: x.scatter_reduce(1, i, s, reduce, include_self=include_self)


def reduce_inputs(dtype=torch.float32):
    return lambda: (data(3, 5, dtype=dtype), idx([[0, 4, 0, 0], [1, 1, 2, 1], [3, 3, 3, 3]]),
                    data(3, 4, dtype=dtype))


REDUCTIONS = [(r, s) for r in ("sum", "prod", "amax", "amin") for s in (True, False)]

SCATTER = [
    *cases("scatter_dim1", lambda x, i, s: x.scatter(1, i, s), lambda: (data(3, 5), distinct((3, 2), 1, 5), data(3, 2)),
           FLOATS),
    *cases("scatter_dim0", lambda x, i, s: x.scatter(0, i, s), lambda: (data(4, 3), distinct((2, 3), 0, 4), data(2, 3)),
           FLOATS),
    *cases("scatter_larger_src", lambda x, i, s: x.scatter(1, i, s),
           lambda: (data(4, 5), distinct((2, 3), 1, 5), data(3, 4)), FLOATS),
    *cases("scatter_3d_neg_dim", lambda x, i, s: x.scatter(-1, i, s),
           lambda: (data(2, 3, 6), distinct((2, 2, 4), 2, 6), data(2, 3, 4)), F32),
    *cases("scatter_value", lambda x, i: x.scatter(1, i, 1.5), lambda: (data(3, 5), distinct((3, 2), 1, 5)), FLOATS),
    *cases("scatter_add", lambda x, i, s: x.scatter_add(1, i, s), reduce_inputs(), FLOATS),
    *cases("scatter_add_dim0", lambda x, i, s: x.scatter_add(0, i, s),
           lambda: (data(3, 4), idx([[0, 2, 2, 0], [0, 0, 1, 2]]), data(2, 4)), F32),
    *[c for r, s in REDUCTIONS for c in cases(f"scatter_reduce_{r}_self{int(s)}", scatter_reduce(r, s),
                                               reduce_inputs(), F32)],
    *[c for r in ("amax", "amin", "sum") for c in cases(f"scatter_reduce_{r}_noself", scatter_reduce(r, False),
                                                         reduce_inputs(), FLOATS[1:])],
    *[c for r, s in REDUCTIONS for c in cases(f"scatter_reduce_{r}_self{int(s)}-int32", scatter_reduce(r, s),
                                               reduce_inputs(torch.int32), (None,))],
    *[c for s in (True, False) for c in cases(f"scatter_reduce_mean_self{int(s)}", scatter_reduce("mean", s),
                                               reduce_inputs(), FLOATS)],
    *[c for s in (True, False) for c in cases(f"scatter_reduce_mean_self{int(s)}-int32", scatter_reduce("mean", s),
                                               reduce_inputs(torch.int32), (None,))],
    *cases("scatter_noncontig", lambda x, i, s: x.transpose(0, 1).scatter(1, i, s),
           lambda: (data(5, 3), distinct((3, 2), 1, 5), data(3, 2)), FLOATS),
    *cases("scatter_empty", lambda x, i, s: x.scatter_add(1, i, s),
           lambda: (data(3, 5), torch.zeros(3, 0, dtype=torch.int64), data(3, 0)), F32),
    *cases("scatter_dynamic", lambda x, i, s: x.scatter_add(1, i, s),
           lambda: (data(4, 5), torch.randint(0, 5, (4, 3)), data(4, 3)), F32,
           dynamic_shapes=dyn({0: R}, {0: R}, {0: R}),
           more_inputs=lambda: [(data(n, 5), torch.randint(0, 5, (n, 3)), data(n, 3)) for n in (2, 17)]),
    *typed("scatter", lambda x, i, s: x.scatter(1, i, s),
           lambda dt: (data(3, 4, dtype=dt), distinct((3, 2), 1, 4), data(3, 2, dtype=dt))),
    *typed("scatter_add", lambda x, i, s: x.scatter_add(0, i, s),
           lambda dt: (data(3, 4, dtype=dt), idx([[0, 2, 2, 0], [0, 0, 1, 2]]), data(2, 4, dtype=dt)), INTS),
]

INDEX_ALONG_DIM = [
    *cases("index_copy", lambda x, i, s: x.index_copy(0, i, s), lambda: (data(5, 3), idx([4, 0, 2]), data(3, 3)),
           FLOATS),
    *cases("index_copy_dim1", lambda x, i, s: x.index_copy(1, i, s),
           lambda: (data(2, 5, 3), idx([1, 3]), data(2, 2, 3)), F32),
    *cases("index_copy_dynamic", lambda x, i, s: x.index_copy(1, i, s),
           lambda: (data(3, 8), distinct((4,), 0, 8), data(3, 4)), F32, dynamic_shapes=dyn(None, {0: N}, {1: N}),
           more_inputs=lambda: [(data(3, 8), distinct((n,), 0, 8), data(3, n)) for n in (2, 8)]),
    *typed("index_copy", lambda x, i, s: x.index_copy(0, i, s),
           lambda dt: (data(4, 2, dtype=dt), idx([3, 1]), data(2, 2, dtype=dt))),
    *cases("index_fill", lambda x, i: x.index_fill(1, i, -2.5), lambda: (data(3, 5), idx([4, 0])), FLOATS),
    *cases("index_fill_tensor", lambda x, i, v: x.index_fill(0, i, v), lambda: (data(4, 3), idx([1, 3]), data()),
           FLOATS),
    *cases("index_fill_negative", lambda x, i: x.index_fill(1, i, 7.0), lambda: (data(3, 5), idx([-1, 1])), F32),
    *cases("index_fill_0d", lambda x, i: x.index_fill(0, i, 7.0), lambda: (data(3, 5), idx(2)), F32),
    *typed("index_fill", lambda x, i: x.index_fill(1, i, 1), lambda dt: (data(3, 4, dtype=dt), idx([0, 2]))),
    *cases("index_add", lambda x, i, s: x.index_add(0, i, s), lambda: (data(5, 3), idx([4, 0, 4, 4]), data(4, 3)),
           FLOATS),
    *cases("index_add_alpha", lambda x, i, s: x.index_add(1, i, s, alpha=-2.0),
           lambda: (data(3, 5), idx([1, 1, 0]), data(3, 3)), F32),
    *typed("index_add", lambda x, i, s: x.index_add(0, i, s),
           lambda dt: (data(4, 2, dtype=dt), idx([3, 3, 1]), data(3, 2, dtype=dt)), INTS),
]

SLICE_SCATTER = [
    *cases("slice_scatter", lambda x, s: torch.slice_scatter(x, s, 1, 1, 3), lambda: (data(4, 5), data(4, 2)), FLOATS),
    *cases("slice_scatter_step", lambda x, s: torch.slice_scatter(x, s, 0, 1, 6, 2),
           lambda: (data(6, 3), data(3, 3)), FLOATS),
    *cases("slice_scatter_full", lambda x, s: torch.slice_scatter(x, s, 1), lambda: (data(2, 4), data(2, 4)), F32),
    *cases("slice_scatter_negative_start", lambda x, s: torch.slice_scatter(x, s, 1, -2),
           lambda: (data(3, 5), data(3, 2)), F32),
    *cases("slice_scatter_end_past_size", lambda x, s: torch.slice_scatter(x, s, 0, 3, 100),
           lambda: (data(5, 2), data(2, 2)), F32),
    *cases("slice_scatter_empty", lambda x, s: torch.slice_scatter(x, s, 1, 2, 2), lambda: (data(3, 4), data(3, 0)),
           F32),
    *cases("slice_scatter_noncontig", lambda x, s: torch.slice_scatter(x.transpose(0, 1), s, 0, 0, 2),
           lambda: (data(3, 4), data(2, 3)), FLOATS),
    *cases("slice_scatter_dynamic_rows", lambda x, s: torch.slice_scatter(x, s, 1, 0, 2),
           lambda: (data(4, 5), data(4, 2)), F32, dynamic_shapes=dyn({0: R}, {0: R}),
           more_inputs=lambda: [(data(n, 5), data(n, 2)) for n in (2, 13)]),
    # A KV-cache style write: the position is a runtime size.
    *cases("slice_scatter_runtime_start",
           lambda c, u, p: torch.slice_scatter(c, u, 0, p.shape[0], p.shape[0] + u.shape[0]),
           lambda: (data(16, 3), data(2, 3), data(5)), F32, dynamic_shapes=dyn(None, None, {0: N}),
           more_inputs=lambda: [(data(16, 3), data(2, 3), data(n)) for n in (2, 14)]),
    *typed("slice_scatter", lambda x, s: torch.slice_scatter(x, s, 0, 1, 3),
           lambda dt: (data(4, 3, dtype=dt), data(2, 3, dtype=dt))),
    *cases("select_scatter", lambda x, s: torch.select_scatter(x, s, 1, 2), lambda: (data(3, 4), data(3)), FLOATS),
    *cases("select_scatter_negative", lambda x, s: torch.select_scatter(x, s, 0, -1),
           lambda: (data(3, 4, 2), data(4, 2)), FLOATS),
    *cases("select_scatter_dynamic", lambda x, s: torch.select_scatter(x, s, 0, -1),
           lambda: (data(4, 3), data(3)), F32, dynamic_shapes=dyn({0: R}, None),
           more_inputs=lambda: [(data(n, 3), data(3)) for n in (2, 10)]),
    *typed("select_scatter", lambda x, s: torch.select_scatter(x, s, 1, 0),
           lambda dt: (data(2, 3, dtype=dt), data(2, dtype=dt))),
]

MASKED_FILL = [
    *cases("masked_fill", lambda x, m: x.masked_fill(m, -1.5), lambda: (data(3, 4), data(3, 4) > 0), FLOATS),
    *cases("masked_fill_tensor", lambda x, m, v: x.masked_fill(m, v), lambda: (data(3, 4), data(3, 4) > 0, data()),
           FLOATS),
    *cases("masked_fill_broadcast_mask", lambda x, m: x.masked_fill(m, 2.0), lambda: (data(2, 3, 4), data(3, 1) > 0),
           FLOATS),
    *cases("masked_fill_neg_inf", lambda x, m: x.masked_fill(m, float("-inf")),
           lambda: (data(2, 5), data(2, 5) > 0), FLOATS),
    *cases("masked_fill_noncontig", lambda x, m: x.transpose(0, 1).masked_fill(m, 0.0),
           lambda: (data(4, 3), data(3, 4) > 0), F32),
    *cases("masked_fill_dynamic", lambda x, m: x.masked_fill(m, 3.0), lambda: (data(4, 3), data(4, 3) > 0), F32,
           dynamic_shapes=dyn({0: R}, {0: R}), more_inputs=lambda: [(data(n, 3), data(n, 3) > 0) for n in (2, 12)]),
    *cases("masked_fill_empty", lambda x, m: x.masked_fill(m, 1.0), lambda: (data(0, 3), data(0, 3) > 0), F32),
    *typed("masked_fill", lambda x, m: x.masked_fill(m, 1), lambda dt: (data(3, 4, dtype=dt), data(3, 4) > 0)),
]

CASES = INDEX_PUT + MASK_PUT + SCATTER + INDEX_ALONG_DIM + SLICE_SCATTER + MASKED_FILL
# An integer mean divides by the per-slot counts: integer division checks its divisor for zero
# on the host, so the runtime keeps these methods node by node (compiles=False).
CASES = amend(CASES, dict.fromkeys(["scatter_reduce_mean_self1-int32", "scatter_reduce_mean_self0-int32"],
                                   "zero-divisor check on the host"), compiles=False)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_scatter(case):
    lower_and_compare(case)


# (name, fn, inputs, words of the refusal, whether ExecuTorch's portable kernels can run the op)
REFUSED = [
    ("scatter_reduce_amax_bool", lambda x, i, s: x.scatter_reduce(1, i, s, "amax"), reduce_inputs(torch.bool),
     "bool", False),
    ("index_put_mask_many_values", lambda x, m, v: x.index_put((m,), v),
     lambda: (data(2, 3), idx([[True, False, True], [False, False, True]], torch.bool), data(3)), "more than one",
     True),
]


@pytest.mark.parametrize("name,fn,inputs,reason,runs", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_stays_on_executorch(name, fn, inputs, reason, runs):
    torch.manual_seed(0)
    args = inputs()
    partitioner = MLXPartitioner()
    lowered = lower(Lambda(fn), args, partitioner=partitioner)
    assert any(reason in r for r in partitioner.rejected.values()), partitioner.rejected
    assert lowered.summary[0] == 0, "the refused op must not be delegated"
    if runs:
        torch.testing.assert_close(lowered.method().execute(list(args))[0], fn(*args))
