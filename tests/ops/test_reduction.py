"""Parity tests for reductions, arg-reductions, variance, scans, softmax,
sorting and selection."""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate import testing
from mlx_delegate.testing import FLOATS, lower_and_compare

aten = torch.ops.aten
# int8 and int16 too: the narrow types wrap on overflow and promote differently in torch
# (sums and products to int64) than MLX does by itself.
INTS = (torch.int8, torch.int16, torch.int32, torch.int64)
NAN = float("nan")


def cases(name, fn, *args, **kw):
    """testing.cases, with torch.return_types results (which export cannot serialize) as tuples."""
    def plain(*inputs):
        out = fn(*inputs)
        return tuple(out) if isinstance(out, tuple) else out
    return testing.cases(name, plain, *args, **kw)


def randn(*shape):
    return lambda: (torch.randn(*shape),)


def ints(dtype, *shape, lo=-5, hi=6):
    return lambda: (torch.randint(lo, hi, shape, dtype=dtype),)


def full_range(dtype, *shape):
    """Integers over the dtype's whole range: a narrow type's sum or product overflows unless it is
    promoted to int64 as torch does (and wraps the same way where int64 itself overflows)."""
    info = torch.iinfo(dtype)
    return lambda: (torch.randint(info.min, info.max, shape, dtype=dtype),)


def bools(*shape):
    return lambda: (torch.rand(*shape) > 0.5,)


def distinct(*shape):
    """A random permutation scaled to floats: no ties, so every index result is unique."""
    return lambda: ((torch.randperm(torch.Size(shape).numel()).reshape(shape).float() - 10) / 4,)


def offset(*shape, mean=100.0):
    """Values far from zero: exposes E[x^2] - E[x]^2 style cancellation in var/std."""
    return lambda: (torch.randn(*shape) + mean,)


def transposed(fn):
    return lambda x: fn(x.transpose(0, 1))


def float_rows(rows):
    return [c for name, fn, inp in rows for c in cases(name, fn, inp, FLOATS)]


def exact_rows(rows, dtypes):
    """Integer/bool rows (compared exactly), one config per dtype."""
    out = []
    for name, fn, make in rows:
        for dt in dtypes:
            inputs = bools(3, 4) if dt == torch.bool else ints(dt, 3, 4)
            out += cases(f"{name}-{str(dt)[6:]}", fn, inputs if make is None else make(dt), (None,))
    return out


# ------------------------------------------------------------- reductions
REDUCE_FLOAT = [
    ("sum", torch.sum, randn(3, 4, 5)), ("sum_dim", lambda x: x.sum(1), randn(3, 4, 5)),
    ("sum_dims_keep", lambda x: x.sum((0, 2), keepdim=True), randn(3, 4, 5)),
    ("sum_neg_dim", lambda x: x.sum(-1), randn(3, 4)), ("sum_empty_dims", lambda x: x.sum(dim=[]), randn(3, 4)),
    ("sum_long_axis", lambda x: x.sum(-1), lambda: (torch.rand(2, 4096),)),
    ("mean", torch.mean, randn(3, 4, 5)), ("mean_dim", lambda x: x.mean(-1), randn(3, 4, 5)),
    ("mean_dims_keep", lambda x: x.mean((0, 1), keepdim=True), randn(3, 4, 5)),
    ("mean_long_axis", lambda x: x.mean(1), lambda: (torch.rand(2, 8192) + 5,)),
    ("amax", lambda x: x.amax(1), randn(3, 4, 5)), ("amin_dims", lambda x: x.amin((0, 2)), randn(3, 4, 5)),
    ("amax_all", lambda x: x.amax(), randn(3, 4)), ("amax_keep", lambda x: x.amax(-1, keepdim=True), randn(3, 4)),
    ("max", torch.max, randn(3, 4)), ("min", torch.min, randn(3, 4)),
    ("max_nan", torch.max, lambda: (torch.tensor([1.0, NAN, 3.0]),)),
    ("prod", torch.prod, lambda: (torch.rand(3, 4) + 0.5,)), ("prod_dim", lambda x: x.prod(1), randn(3, 4)),
    ("prod_keep", lambda x: x.prod(0, keepdim=True), randn(3, 4)),
    ("logsumexp", lambda x: x.logsumexp(1), randn(3, 4, 5)),
    ("logsumexp_dims", lambda x: torch.logsumexp(x * 10, (0, 2), keepdim=True), randn(3, 4, 5)),
    ("logsumexp_inf", lambda x: x.logsumexp(1), lambda: (torch.tensor([[-float("inf")] * 3, [1.0, 2.0, 3.0]]),)),
    ("any", torch.any, lambda: (torch.randn(3, 4) > 1.5,)), ("any_float", lambda x: x.any(1), randn(3, 4)),
    ("all_float", lambda x: torch.all(x > -1.0, 1), randn(3, 4)),
    ("sum_nc", transposed(lambda x: x.sum(1)), randn(4, 3)), ("mean_nc", transposed(lambda x: x.mean(0)), randn(4, 3)),
    ("amax_nc", transposed(lambda x: x.amax(1)), randn(4, 3)),
    ("sum_zero_size", lambda x: x.sum(0), randn(0, 3)), ("prod_zero_size", lambda x: x.prod(1), randn(3, 0)),
    ("mean_zero_dim", lambda x: x.mean(1), randn(0, 3)),
    ("sum_0d", lambda x: x.sum(0), lambda: (torch.tensor(2.5),)),
    ("count_nonzero", lambda x: torch.count_nonzero(x > 0, 1), randn(3, 4)),
    ("nansum", torch.nansum, lambda: (torch.tensor([1.0, NAN, 2.0]),)),
    ("aminmax", lambda x: torch.aminmax(x, dim=1), randn(3, 4)),
]

# sums/products of ints and bools give int64; `dtype=` is respected.
REDUCE_INT = [
    ("sum", torch.sum, None), ("sum_dim", lambda x: x.sum(1), None), ("prod", lambda x: x.prod(1), None),
    ("amax", lambda x: x.amax(0), None), ("max", torch.max, None), ("min_all", torch.min, None),
    ("any_dim", lambda x: x.any(1), None), ("all", torch.all, None), ("all_dims", lambda x: torch.all(x, (0, 1)), None),
    ("sum_dtype_float", lambda x: x.sum(0, dtype=torch.float32), None), ("cumsum", lambda x: x.cumsum(1), None),
]
REDUCE_FULL_RANGE = [
    ("sum_full_range", lambda x: x.sum(1), lambda dt: full_range(dt, 3, 4)),
    ("cumsum_full_range", lambda x: x.cumsum(1), lambda dt: full_range(dt, 3, 4)),
    ("prod_full_range", lambda x: x.prod(1), lambda dt: full_range(dt, 3, 4)),
]
REDUCE_DTYPE = [
    ("sum_dtype_f32", lambda x: x.half().sum(1, dtype=torch.float32), randn(3, 4)),
    ("sum_dtype_f16", lambda x: x.sum(1, dtype=torch.float16), randn(3, 4)),
    ("mean_dtype", lambda x: x.half().mean(1, dtype=torch.float32), randn(3, 4)),
    ("prod_dtype", lambda x: x.prod(1, dtype=torch.int32), ints(torch.int64, 3, 4)),
    ("cumsum_dtype", lambda x: x.cumsum(0, dtype=torch.float32), ints(torch.int32, 5)),
    ("any_uint8", lambda x: x.any(1), ints(torch.uint8, 3, 4, lo=0, hi=2)),
    ("all_uint8", torch.all, ints(torch.uint8, 3, 4, lo=1, hi=3)),
    ("logsumexp_int", lambda x: x.logsumexp(1), ints(torch.int32, 3, 4)),
]


# ----------------------------------------------------- arg / value+index
ARG_ROWS = [
    ("argmax", lambda x: x.argmax(1), distinct(3, 4, 5)), ("argmin", lambda x: x.argmin(-1), distinct(3, 4)),
    ("argmax_none", lambda x: x.argmax(), distinct(3, 4)), ("argmin_keep", lambda x: x.argmin(0, keepdim=True), distinct(3, 4)),
    ("argmax_none_keep", lambda x: torch.argmax(x, keepdim=True), distinct(3, 4)),
    ("argmax_1d_keep", lambda x: torch.argmax(x, keepdim=True), distinct(7)),
    ("argmax_ties", lambda x: x.argmax(1), lambda: (torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, -1.0]]),)),
    ("argmin_nan", lambda x: x.argmin(), lambda: (torch.tensor([1.0, 0.0, NAN, 0.0]),)),
    ("max_dim", lambda x: x.max(1), distinct(3, 4)), ("min_dim_keep", lambda x: x.min(0, keepdim=True), distinct(3, 4)),
    ("max_dim_values", lambda x: x.max(-1)[0] * 2, distinct(3, 4)),
    ("max_dim_indices", lambda x: x.max(-1)[1], distinct(3, 4)),
    ("max_dim_ties", lambda x: x.max(1), lambda: (torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, -1.0]]),)),
    ("max_dim_nan", lambda x: x.max(1), lambda: (torch.tensor([[1.0, NAN, 3.0], [0.0, 2.0, -1.0]]),)),
    ("argmax_nc", transposed(lambda x: x.argmax(1)), distinct(4, 3)),
    ("max_dim_0d", lambda x: x.max(0), lambda: (torch.tensor(1.5),)),
]
ARG_INT = [
    ("max_dim", lambda x: x.max(1), lambda dt: (lambda: (torch.randperm(12).reshape(3, 4).to(dt),))),
    ("argmin", lambda x: x.argmin(0), lambda dt: (lambda: (torch.randperm(12).reshape(3, 4).to(dt),))),
]


# ------------------------------------------------------------ var / std
VAR_ROWS = [
    ("var", torch.var, randn(3, 4, 5)), ("var_dim", lambda x: x.var(1), randn(3, 4, 5)),
    ("var_unbiased_false", lambda x: x.var(1, unbiased=False), randn(3, 4)),
    ("var_correction0_keep", lambda x: x.var((0, 2), correction=0, keepdim=True), randn(3, 4, 5)),
    ("var_correction2", lambda x: torch.var(x, -1, correction=2), randn(3, 6)),
    ("std", torch.std, randn(3, 4)), ("std_dim", lambda x: x.std(0), randn(3, 4)),
    ("std_correction0", lambda x: x.std((0, 1), correction=0), randn(3, 4, 2)),
    ("var_offset", lambda x: x.var(1), offset(4, 1000)), ("std_offset", lambda x: x.std(1), offset(4, 1000)),
    ("var_single", lambda x: x.var(1), randn(3, 1)),  # N - correction = 0: nan, as torch
    ("var_overcorrected", lambda x: x.var(1, correction=3), randn(3, 2)),  # max(0, N - c) = 0: inf
    ("var_nc", transposed(lambda x: x.var(1)), randn(4, 3)),
]


# ------------------------------------------------------- scans, softmax
SCAN_ROWS = [
    ("cumsum", lambda x: x.cumsum(1), randn(3, 5)), ("cumsum_neg", lambda x: x.cumsum(-1), randn(2, 3, 4)),
    ("cumsum_long", lambda x: x.cumsum(1), lambda: (torch.rand(2, 2048),)),
    ("cumsum_dim0", lambda x: x.cumsum(0), randn(4, 3)), ("cumsum_nc", transposed(lambda x: x.cumsum(1)), randn(5, 3)),
    ("cumsum_zero_size", lambda x: x.cumsum(0), randn(0, 3)),
]
SOFTMAX_ROWS = [
    ("softmax", lambda x: x.softmax(-1), randn(3, 4, 5)), ("softmax_dim0", lambda x: F.softmax(x, 0), randn(3, 4)),
    ("log_softmax", lambda x: F.log_softmax(x, -1), randn(3, 4, 5)),
    ("log_softmax_dim1", lambda x: F.log_softmax(x, 1), randn(3, 4, 5)),
    ("softmax_large", lambda x: (x * 30).softmax(-1), randn(2, 64)),
    ("log_softmax_large", lambda x: F.log_softmax(x * 30, -1), randn(2, 64)),
    ("softmax_masked", lambda x: torch.where(x > 0, x, -float("inf")).softmax(-1), randn(3, 8)),
    ("_softmax", lambda x: aten._softmax(x, 1, False), randn(3, 4)),
    ("_log_softmax", lambda x: aten._log_softmax(x, 0, False), randn(3, 4)),
    ("softmax_nc", transposed(lambda x: x.softmax(-1)), randn(4, 3)),
    ("softmax_zero_size", lambda x: x.softmax(-1), randn(0, 4)),
]
SOFTMAX_DTYPE = [
    ("softmax_dtype_f32", lambda x: F.softmax(x.half(), -1, dtype=torch.float32), randn(3, 4)),
    ("log_softmax_dtype_f32", lambda x: F.log_softmax(x.half(), -1, dtype=torch.float32), randn(3, 4)),
    ("softmax_int_overload", lambda x: aten.softmax.int(x, 1, torch.float16), randn(3, 4)),
]


# ------------------------------------------------------ sort, topk
SORT_ROWS = [
    ("sort", lambda x: x.sort(1), distinct(3, 6)), ("sort_desc", lambda x: x.sort(-1, descending=True), distinct(3, 6)),
    ("sort_dim0", lambda x: torch.sort(x, 0), distinct(4, 3)), ("argsort", lambda x: x.argsort(1), distinct(3, 6)),
    ("argsort_desc", lambda x: x.argsort(0, descending=True), distinct(4, 3)),
    ("msort", torch.msort, distinct(5, 2)), ("sort_values_only", lambda x: x.sort(1)[0] + 1, distinct(3, 6)),
    ("sort_nan", lambda x: x.sort(1), lambda: (torch.tensor([[3.0, NAN, 1.0, NAN, 2.0]]),)),
    ("sort_nan_desc", lambda x: x.sort(1, descending=True), lambda: (torch.tensor([[3.0, NAN, 1.0, NAN, 2.0]]),)),
    ("sort_nc", transposed(lambda x: x.sort(1)), distinct(6, 3)),
    ("topk", lambda x: x.topk(3, 1), distinct(3, 8)), ("topk_smallest", lambda x: x.topk(2, -1, largest=False), distinct(3, 8)),
    ("topk_dim0", lambda x: torch.topk(x, 2, 0), distinct(5, 3)), ("topk_all", lambda x: x.topk(6), distinct(2, 6)),
    ("topk_k0", lambda x: x.topk(0), distinct(2, 6)),
    # Unsorted top-k may come in any order: compare the sorted values and the set of indices.
    ("topk_unsorted", lambda x: [t.sort(-1)[0] for t in x.topk(3, -1, sorted=False)], distinct(3, 8)),
    ("topk_nc", transposed(lambda x: x.topk(2, 1)), distinct(6, 3)),
]
SORT_INT = [
    ("sort", lambda x: x.sort(1), lambda dt: (lambda: (torch.randperm(12).reshape(3, 4).to(dt) - 6,))),
    ("topk", lambda x: x.topk(2, 1), lambda dt: (lambda: (torch.randperm(12).reshape(3, 4).to(dt) - 6,))),
    ("argsort_desc", lambda x: x.argsort(1, descending=True),
     lambda dt: (lambda: (torch.randperm(12).reshape(3, 4).to(dt),))),
]


# ------------------------------------------------------- dynamic shapes
rows_dim = Dim("rows", min=1, max=64)
cols_dim = Dim("cols", min=2, max=64)


def _dyn(name, fn, shape, spec, more):
    """A row exported with a dynamic dim in each float dtype, run at other sizes (1 where the dim allows)."""
    # A `Lambda` takes its inputs as one *args tuple, hence the extra nesting.
    return cases(name, fn, lambda: (torch.randn(*shape),), FLOATS, dynamic_shapes=((spec,),),
                 more_inputs=lambda: [(torch.randn(*s),) for s in more])


DYNAMIC = [
    *_dyn("dyn_sum", lambda x: x.sum(1), (3, 4), {0: rows_dim, 1: cols_dim}, [(7, 9), (1, 2)]),
    *_dyn("dyn_mean_keep", lambda x: x.mean(-1, keepdim=True), (3, 4), {1: cols_dim}, [(3, 17)]),
    *_dyn("dyn_softmax", lambda x: x.softmax(-1), (3, 4), {0: rows_dim, 1: cols_dim}, [(5, 33), (1, 6)]),
    *_dyn("dyn_var", lambda x: x.var(1), (3, 4), {1: cols_dim}, [(3, 10)]),
    *_dyn("dyn_argmax", lambda x: x.argmax(-1), (3, 4), {1: cols_dim}, [(3, 12)]),
    *_dyn("dyn_max_dim", lambda x: x.max(0), (3, 4), {0: rows_dim}, [(9, 4), (1, 4)]),
    *_dyn("dyn_cumsum", lambda x: x.cumsum(1), (3, 4), {1: cols_dim}, [(3, 20)]),
    *_dyn("dyn_sort", lambda x: x.sort(-1, descending=True), (3, 4), {1: cols_dim}, [(3, 11)]),
    *_dyn("dyn_topk", lambda x: x.topk(2, -1), (3, 4), {1: cols_dim}, [(3, 13)]),
]

# MLX's variance takes an integer ddof: a fractional correction stays on ExecuTorch.
REFUSED = [
    *cases("var_fractional_correction", lambda x: x.var(1, correction=0.5), randn(3, 4), (None,), segments=0,
           allowed_fallback=frozenset({"var"})),
]

# Equal-width bins; values outside [min, max] are not counted, max itself is in the last bin.
HISTC = [
    *cases("histc_expert_ids", lambda x: torch.histc(x, bins=4, min=0, max=3),
           lambda: (torch.randint(0, 4, (5, 2)).float(),), FLOATS, exact=True),
    *cases("histc_clipped_range", lambda x: torch.histc(x, bins=7, min=-1, max=1.5),
           lambda: (torch.cat([torch.randn(40), torch.tensor([-1.0, 1.5, 3.0])]),), (torch.float32,), exact=True),
    *cases("histc_dynamic", lambda x: torch.histc(x, bins=3, min=0, max=2), lambda: (torch.randint(0, 3, (6,)).float(),),
           (torch.float32,), exact=True, dynamic_shapes=(({0: Dim("n", min=1, max=64)},),),
           more_inputs=lambda: [(torch.randint(0, 3, (1,)).float(),), (torch.randint(0, 3, (50,)).float(),)]),
]

CASES = [
    *HISTC, *float_rows(REDUCE_FLOAT), *exact_rows(REDUCE_INT, INTS + (torch.bool,)),
    *exact_rows(REDUCE_FULL_RANGE, INTS),
    *[c for name, fn, inp in REDUCE_DTYPE for c in cases(name, fn, inp, (None,))],
    *float_rows(ARG_ROWS), *exact_rows(ARG_INT, INTS), *float_rows(VAR_ROWS), *float_rows(SCAN_ROWS),
    *float_rows(SOFTMAX_ROWS), *[c for name, fn, inp in SOFTMAX_DTYPE for c in cases(name, fn, inp, (None,))],
    *float_rows(SORT_ROWS), *exact_rows(SORT_INT, INTS), *DYNAMIC, *REFUSED,
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reduction(case):
    lower_and_compare(case)


# ---------------------------------------- ops that are not core ATen
# EXIR accepts these only when the exporter lists them as exceptions to the core ATen check.
NONCORE_OPS = [aten.cumprod.default, aten.sort.stable, aten.median.default, aten.median.dim,
               aten.var_mean.correction]

NONCORE = [
    *float_rows([
        ("cumprod", lambda x: x.cumprod(1), lambda: (torch.rand(3, 6) + 0.5,)),
        ("cumprod_long", lambda x: x.cumprod(-1), lambda: (torch.rand(2, 256) * 0.02 + 0.995,)),
        ("sort_stable", lambda x: x.sort(dim=1, stable=True), lambda: (torch.randint(0, 3, (3, 8)).float(),)),
        ("sort_stable_desc", lambda x: x.sort(dim=-1, stable=True, descending=True),
         lambda: (torch.randint(0, 3, (3, 8)).float(),)),
        ("argsort_stable", lambda x: x.argsort(dim=0, stable=True), lambda: (torch.randint(0, 3, (6, 3)).float(),)),
        ("median", torch.median, distinct(3, 5)), ("median_even", torch.median, distinct(4, 2)),
        ("median_dim", lambda x: x.median(1), distinct(3, 5)),
        ("median_dim_keep", lambda x: x.median(0, keepdim=True), distinct(4, 3)),
        ("median_nan", lambda x: x.median(1), lambda: (torch.tensor([[3.0, NAN, 1.0, NAN, 2.0], [5, 4, 3, 2, 1]]),)),
        ("median_nc", transposed(lambda x: x.median(1)), distinct(5, 3)),
        ("var_mean", lambda x: torch.var_mean(x, 1), randn(3, 4)),
        ("std_mean", lambda x: torch.std_mean(x, (0, 1), correction=0, keepdim=True), randn(3, 4)),
    ]),
    *exact_rows([
        ("cumprod", lambda x: x.cumprod(1), lambda dt: ints(dt, 3, 4, lo=-3, hi=4)),
        ("sort_stable", lambda x: x.sort(dim=1, stable=True, descending=True), lambda dt: ints(dt, 3, 8, lo=0, hi=3)),
        ("median_dim", lambda x: x.median(1), lambda dt: (lambda: (torch.randperm(15).reshape(3, 5).to(dt),))),
    ], INTS),
]


@pytest.mark.parametrize("case", NONCORE, ids=str)
def test_noncore_reduction(case):
    lower_and_compare(case, keep_ops=NONCORE_OPS)
