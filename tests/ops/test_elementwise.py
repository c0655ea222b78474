"""Parity tests for element-wise ops: unary math, binary arithmetic, division
semantics, comparisons, logic, bitwise ops, where and clamp."""

import pytest
import torch
from torch.export import Dim

from mlx_delegate import testing
from mlx_delegate.testing import FLOATS, amend, cases, lower_and_compare

aten = torch.ops.aten
# int8 and int16 too: the narrow types wrap on overflow and promote differently in torch
# (sums and products to int64) than MLX does by itself.
INTS = (torch.int8, torch.int16, torch.int32, torch.int64)
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------ inputs
def randn(*shape):
    return lambda: (torch.randn(*shape),)


def uniform(lo, hi, *shape):
    return lambda: (torch.rand(*shape) * (hi - lo) + lo,)


def positive(*shape):
    return uniform(0.1, 3.0, *shape)


def two(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


def ints(dtype, *shape, lo=-9, hi=10):
    return lambda: (torch.randint(lo, hi, shape, dtype=dtype),)


def two_ints(dtype, *shapes, lo=-9, hi=10):
    return lambda: tuple(torch.randint(lo, hi, s, dtype=dtype) for s in shapes)


def full_range_ints(dtype, *shapes):
    """Integers over the dtype's whole range: sums and products overflow and must wrap as torch's do."""
    info = torch.iinfo(dtype)
    return lambda: tuple(torch.randint(info.min, info.max, s, dtype=dtype) for s in shapes)


def values(*vals, dtype=torch.float32):
    return lambda: (torch.tensor(vals, dtype=dtype),)


def specials():
    """Finite values mixed with nan and +-inf."""
    return values(1.0, -2.5, NAN, INF, -INF, 0.0, 3.0, -0.0)


def transposed(fn):
    """fn applied to the transpose of its first input (a non-contiguous view)."""
    return lambda x, *rest: fn(x.transpose(0, 1), *rest)


# ------------------------------------------------------------------- unary
# (name, fn, inputs); every row runs in fp32, fp16 and bf16.
UNARY_FLOAT = [
    ("neg", torch.neg, randn(3, 4)), ("abs", torch.abs, randn(3, 4)), ("exp", torch.exp, randn(3, 4)),
    ("log", torch.log, positive(2, 3)), ("sqrt", torch.sqrt, positive(5)), ("rsqrt", torch.rsqrt, positive(5)),
    ("sin", torch.sin, randn(3, 4)), ("cos", torch.cos, randn(3, 4)), ("tan", torch.tan, uniform(-1, 1, 6)),
    ("tanh", torch.tanh, randn(3, 4)), ("sigmoid", torch.sigmoid, randn(3, 4)), ("erf", torch.erf, randn(7)),
    ("floor", torch.floor, randn(9)), ("ceil", torch.ceil, randn(9)),
    ("round_half_even", torch.round, values(0.5, 1.5, 2.5, -0.5, -1.5, 0.4, -2.6, 7.0)),
    ("sign", torch.sign, values(-2.0, 0.0, 3.5, -0.0, NAN, INF)), ("square", torch.square, randn(3, 4)),
    ("reciprocal", torch.reciprocal, positive(6)), ("expm1", torch.expm1, uniform(-1, 1, 6)),
    ("log1p", torch.log1p, positive(6)), ("log2", torch.log2, positive(6)), ("log10", torch.log10, positive(6)),
    ("asin", torch.asin, uniform(-0.9, 0.9, 6)), ("acos", torch.acos, uniform(-0.9, 0.9, 6)),
    ("atan", torch.atan, randn(6)), ("sinh", torch.sinh, randn(6)), ("cosh", torch.cosh, randn(6)),
    ("asinh", torch.asinh, randn(6)), ("acosh", torch.acosh, uniform(1.1, 4, 6)),
    ("atanh", torch.atanh, uniform(-0.8, 0.8, 6)), ("trunc", torch.trunc, uniform(-4, 4, 9)),
    ("frac", torch.frac, uniform(-4, 4, 9)),
    ("isnan", torch.isnan, specials()), ("isinf", torch.isinf, specials()), ("isfinite", torch.isfinite, specials()),
    ("isposinf", torch.isposinf, specials()), ("isneginf", torch.isneginf, specials()),
    ("logical_not", torch.logical_not, specials()), ("nan_to_num", torch.nan_to_num, specials()),
    ("sgn", torch.sgn, randn(5)),
]

# (name, fn, inputs, dtypes) for integer and boolean inputs; results compare exactly.
UNARY_INT = [
    ("abs", torch.abs, INTS), ("neg", torch.neg, INTS), ("sign", torch.sign, INTS),
    ("square", torch.square, INTS), ("floor", torch.floor, INTS), ("round", torch.round, INTS),
    ("trunc", torch.trunc, INTS), ("bitwise_not", torch.bitwise_not, INTS + (torch.uint8,)),
    ("logical_not", torch.logical_not, INTS), ("isnan", torch.isnan, INTS), ("isinf", torch.isinf, INTS),
    ("isfinite", torch.isfinite, INTS),
    # int -> float ops compute in float32, as torch does.
    ("exp_int", torch.exp, INTS), ("sigmoid_int", torch.sigmoid, INTS), ("sqrt_int", torch.sqrt, INTS),
    ("sin_int", torch.sin, INTS), ("reciprocal_int", torch.reciprocal, (torch.int32,)),
]

UNARY_BOOL = [
    ("bitwise_not", torch.bitwise_not), ("logical_not", torch.logical_not), ("sign", torch.sign),
    ("square", torch.square), ("abs_int", lambda x: torch.abs(x.int())), ("exp", torch.exp),
]


def _unary_cases():
    out = [c for name, fn, inp in UNARY_FLOAT for c in cases(name, fn, inp, FLOATS)]
    for name, fn, dtypes in UNARY_INT:
        lo = 1 if name in ("reciprocal_int", "sqrt_int") else -9
        out += [c for dt in dtypes for c in cases(f"{name}-{dt}".replace("torch.", ""), fn,
                                                 ints(dt, 3, 4, lo=max(lo, 0) if dt == torch.uint8 else lo), (None,))]
    bools = lambda: (torch.rand(3, 4) > 0.5,)  # noqa: E731
    out += [c for name, fn in UNARY_BOOL for c in cases(f"{name}-bool", fn, bools, (None,))]
    return out


# ------------------------------------------------------------------ binary
# (name, fn, inputs); inputs broadcast against each other on purpose.
BINARY_FLOAT = [
    ("add", torch.add, two((3, 4), (4,))), ("add_alpha", lambda x, y: torch.add(x, y, alpha=2.5), two((3, 4), (3, 4))),
    ("sub", torch.sub, two((2, 1, 4), (3, 1))), ("sub_alpha", lambda x, y: torch.sub(x, y, alpha=-0.5), two((4,), (2, 4))),
    ("mul", torch.mul, two((3, 4), (3, 1))), ("div", torch.div, lambda: (torch.randn(3, 4), torch.rand(4) + 0.5)),
    ("maximum", torch.maximum, two((3, 4), (4,))), ("minimum", torch.minimum, two((3, 4), (4,))),
    ("atan2", torch.atan2, two((3, 4), (3, 4))), ("logaddexp", torch.logaddexp, two((3, 4), (4,))),
    ("pow", torch.pow, lambda: (torch.rand(3, 4) + 0.5, torch.randn(4))),
    ("remainder", torch.remainder, lambda: (torch.randn(3, 4) * 5, torch.randn(4) * 2)),
    ("fmod", torch.fmod, lambda: (torch.randn(3, 4) * 5, torch.randn(4) * 2)),
    ("floor_divide", torch.floor_divide, lambda: (torch.randn(3, 4) * 5, torch.randn(4) * 2)),
    ("div_floor", lambda x, y: torch.div(x, y, rounding_mode="floor"), lambda: (torch.randn(3, 4) * 5, torch.randn(4))),
    ("div_trunc", lambda x, y: torch.div(x, y, rounding_mode="trunc"), lambda: (torch.randn(3, 4) * 5, torch.randn(4))),
    ("max_nan", torch.maximum, lambda: (torch.tensor([NAN, 1.0, 2.0]), torch.tensor([0.0, NAN, 3.0]))),
    ("min_nan", torch.minimum, lambda: (torch.tensor([NAN, 1.0, 2.0]), torch.tensor([0.0, NAN, 3.0]))),
    ("xlogy", torch.xlogy, lambda: (torch.tensor([0.0, 1.0, 2.0, 0.0]), torch.tensor([0.0, 2.0, 0.5, NAN]))),
    ("addcmul", lambda x, y: torch.addcmul(x, x, y, value=0.5), two((3, 4), (4,))),
    ("lerp", lambda x, y: torch.lerp(x, y, 0.3), two((3, 4), (3, 4))),
    ("mul_nc", transposed(torch.mul), two((4, 3), (3, 4))), ("add_nc", transposed(torch.add), two((4, 3), (4,))),
    ("sub_zero_size", torch.sub, two((0, 4), (4,))), ("mul_zero_size", torch.mul, two((2, 0), (1,))),
]

# (name, fn); the scalar sits in the fn. Includes the explicit *.Scalar overloads.
SCALAR_FLOAT = [
    ("add_scalar", lambda x: x + 2.5), ("add.Scalar", lambda x: aten.add.Scalar(x, 2)),
    ("sub.Scalar", lambda x: aten.sub.Scalar(x, 1.5)), ("rsub", lambda x: 1 - x),
    ("rsub.Scalar", lambda x: aten.rsub.Scalar(x, 3, 2)), ("mul_scalar", lambda x: x * 3),
    ("mul.Scalar", lambda x: aten.mul.Scalar(x, -2)), ("div_scalar", lambda x: x / 4),
    ("div.Scalar", lambda x: aten.div.Scalar(x, 0.5)), ("pow_int_exp", lambda x: x ** 3),
    ("pow_neg_exp", lambda x: x ** -2), ("pow_half", lambda x: x.abs() ** 0.5), ("rpow", lambda x: 2 ** x),
    ("pow.Scalar", lambda x: aten.pow.Scalar(3.0, x)), ("remainder.Scalar", lambda x: x % 1.5),
    ("fmod.Scalar", lambda x: torch.fmod(x, -1.5)), ("floordiv_scalar", lambda x: x // 0.75),
    # Divisors exact in bf16: export turns the scalar into a tensor of x's dtype, eager keeps it in
    # double, so an inexact one (0.7) changes the reference, not us.
    ("div_trunc_scalar", lambda x: torch.div(x, 0.75, rounding_mode="trunc")),
]

# (name, fn, inputs) on integer tensors (int32 and int64), compared exactly.
ARITH_INT = [
    ("add", torch.add, two_ints), ("sub_alpha", lambda x, y: torch.sub(x, y, alpha=3), two_ints),
    ("mul", torch.mul, two_ints), ("div_true", torch.div, None), ("maximum", torch.maximum, two_ints),
    ("minimum", torch.minimum, two_ints), ("add_scalar", lambda x, y: x + 7, two_ints),
    ("mul_float_scalar", lambda x, y: x * 1.5, two_ints), ("pow_int", lambda x, y: x ** 3, two_ints),
    ("pow_zero", lambda x, y: x ** 0, two_ints), ("rpow_float", lambda x, y: 2.0 ** x, two_ints),
    # Negative operands follow Python's sign rules (remainder/floor) and C's (fmod/trunc).
    ("remainder", lambda x, y: x % 3, two_ints), ("remainder_neg", lambda x, y: torch.remainder(x, -4), two_ints),
    ("fmod", lambda x, y: torch.fmod(x, 3), two_ints), ("fmod_neg", lambda x, y: torch.fmod(x, -4), two_ints),
    ("floordiv", lambda x, y: x // 3, two_ints), ("floordiv_neg", lambda x, y: x // -4, two_ints),
    ("div_floor", lambda x, y: torch.div(x, 3, rounding_mode="floor"), two_ints),
    ("div_trunc", lambda x, y: torch.div(x, 3, rounding_mode="trunc"), two_ints),
    ("div_trunc_neg", lambda x, y: torch.div(x, -4, rounding_mode="trunc"), two_ints),
    ("bitwise_and", torch.bitwise_and, two_ints), ("bitwise_or", torch.bitwise_or, two_ints),
    ("bitwise_xor", torch.bitwise_xor, two_ints), ("and_scalar", lambda x, y: x & 6, two_ints),
    ("or_scalar", lambda x, y: x | 8, two_ints), ("xor_scalar", lambda x, y: x ^ 5, two_ints),
    ("add_wraps", torch.add, full_range_ints), ("mul_wraps", torch.mul, full_range_ints),
]


def _int_arith_cases():
    out = []
    for name, fn, make in ARITH_INT:
        for dt in INTS:
            inputs = make(dt, (3, 4), (4,)) if make else two_ints(dt, (3, 4), (4,), lo=1)
            out += cases(f"{name}-{str(dt)[6:]}", fn, inputs, (None,))
    return out


def floats_exact(*pairs):
    """Two float tensors from (x, y) pairs, for rows checking specific values."""
    return lambda: (torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs]))


SEMANTICS = [
    # torch floors (a - fmod(a, b)) / b: 1 // 0.1 is 9, not floor(1 / 0.1) = 10.
    *cases("floor_divide_exact", torch.floor_divide,
           floats_exact((1.0, 0.1), (-1.0, 0.1), (7.0, 2.0), (-7.0, 2.0), (7.0, -2.0), (5.0, 0.0), (-5.0, 0.0),
                        (0.0, 0.0), (0.3, 0.1)), FLOATS),
    *cases("remainder_signs", torch.remainder,
           floats_exact((5.5, 2.0), (-5.5, 2.0), (5.5, -2.0), (-5.5, -2.0), (-1e-8, 1.0), (3.0, 0.0), (INF, 2.0)),
           FLOATS),
    *cases("fmod_signs", torch.fmod,
           floats_exact((5.5, 2.0), (-5.5, 2.0), (5.5, -2.0), (-5.5, -2.0), (-1e-8, 1.0), (3.0, 0.0), (2.0, INF)),
           FLOATS),
]

# Integer division by a tensor divisor is lowered; a zero divisor raises at run time as in torch
# (test_integer_division_by_zero_raises).
# Integer division by a tensor checks the divisor for zero on the host (an item() of a computed
# tensor): the runtime keeps these methods node by node (compiles=False).
INT_TENSOR_DIVISORS = amend([
    *cases("int_remainder_tensor", torch.remainder, two_ints(torch.int32, (3, 4), (4,), lo=1), (None,)),
    *cases("int_remainder_neg_tensor", torch.remainder, two_ints(torch.int64, (3, 4), (4,), lo=-5, hi=-1), (None,)),
    *cases("int_fmod_tensor", torch.fmod, two_ints(torch.int64, (3, 4), (3, 1), lo=-5, hi=-1), (None,)),
    *cases("int_floordiv_tensor", lambda x, y: torch.div(x, y, rounding_mode="floor"),
           two_ints(torch.int64, (3, 4), (4,), lo=1), (None,)),
    *cases("int_truncdiv_tensor", lambda x, y: torch.div(x, y, rounding_mode="trunc"),
           two_ints(torch.int32, (3, 4), (4,), lo=-6, hi=-1), (None,)),
    # A negative integer exponent gives 0, or +-1 for bases +-1 (torch's powi).
    *cases("int_pow_tensor", torch.pow, two_ints(torch.int32, (4, 7), (7,), lo=-3, hi=4), (None,)),
], dict.fromkeys(["int_remainder_tensor", "int_remainder_neg_tensor", "int_fmod_tensor", "int_floordiv_tensor",
                  "int_truncdiv_tensor"], "zero-divisor check on the host"), compiles=False)
REFUSED = [
    *cases("float64", torch.exp, lambda: (torch.randn(4, dtype=torch.float64),), (None,), segments=0,
           allowed_fallback=frozenset({"exp"})),
]


# ------------------------------------------------- comparisons, logic, where
COMPARE = [
    ("eq", torch.eq), ("ne", torch.ne), ("lt", torch.lt), ("le", torch.le), ("gt", torch.gt), ("ge", torch.ge),
]
COMPARE_SCALAR = [
    ("eq.Scalar", lambda x: aten.eq.Scalar(x, 0.5)), ("ne_scalar", lambda x: x != 0),
    ("lt_scalar", lambda x: x < 0.1), ("le.Scalar", lambda x: aten.le.Scalar(x, 0)),
    ("gt_scalar", lambda x: x > -0.25), ("ge_scalar", lambda x: x >= 1),
]


def _rounded(*shapes):
    """Inputs on a coarse grid, so equality rows see ties."""
    return lambda: tuple(torch.randint(-2, 3, s).float() * 0.5 for s in shapes)


def _compare_cases():
    out = []
    for name, fn in COMPARE:
        out += cases(name, fn, _rounded((3, 4), (4,)), FLOATS)
        out += cases(f"{name}-int", fn, two_ints(torch.int32, (3, 4), (3, 1), lo=-2, hi=3), (None,))
    out += [c for name, fn in COMPARE_SCALAR for c in cases(name, fn, _rounded((3, 4)), FLOATS)]
    return out + [
        # int tensor vs float scalar compares in float; mixed float dtypes promote.
        *cases("int_lt_float", lambda x: x < 0.5, ints(torch.int64, 6, lo=-2, hi=3), (None,)),
        *cases("half_vs_float", lambda x, y: x.half() > y, two((3, 4), (4,)), (None,)),
        *cases("eq_bool", torch.eq, lambda: (torch.rand(5) > 0.5, torch.rand(5) > 0.5), (None,)),
        *cases("gt_nan", lambda x: x > 0, specials(), (None,)),
        *cases("lt_nc", transposed(torch.lt), two((4, 3), (3, 4)), (None,)),
    ]


LOGIC = [
    ("logical_and", torch.logical_and), ("logical_or", torch.logical_or), ("logical_xor", torch.logical_xor),
]


def _mixed_truthy():
    return lambda: (torch.tensor([0.0, 1.5, -2.0, 0.0]), torch.tensor([0, 0, 3, 4], dtype=torch.int32))


def _logic_cases():
    out = []
    for name, fn in LOGIC:
        out += cases(name, fn, _mixed_truthy(), (None,))
        out += cases(f"{name}-bool", fn, lambda: (torch.rand(3, 4) > 0.5, torch.rand(4) > 0.5), (None,))
    bools = lambda: (torch.rand(3, 4) > 0.5, torch.rand(3, 4) > 0.3)  # noqa: E731
    return out + [
        *cases("and-bool", lambda x, y: x & y, bools, (None,)), *cases("or-bool", lambda x, y: x | y, bools, (None,)),
        *cases("xor-bool", lambda x, y: x ^ y, bools, (None,)),
        *cases("uint8_and", torch.bitwise_and, lambda: (torch.randint(0, 255, (6,), dtype=torch.uint8),
                                                        torch.randint(0, 255, (6,), dtype=torch.uint8)), (None,)),
    ]


WHERE = [
    *cases("where", lambda x, y: torch.where(x > 0, x, y), two((3, 4), (4,)), FLOATS),
    *cases("where_scalar_branches", lambda x: torch.where(x > 0, 1.0, -1.0), randn(3, 4), FLOATS),
    *cases("where_scalar_other", lambda x: torch.where(x > 0, x, 0.5), randn(3, 4), FLOATS),
    *cases("where_scalar_self", lambda x: torch.where(x > 0, -2, x), randn(3, 4), FLOATS),
    *cases("where_int", lambda x, y: torch.where(x > y, x, y), two_ints(torch.int64, (3, 4), (4,)), (None,)),
    *cases("where_int_scalar", lambda x: torch.where(x > 0, x, 0), ints(torch.int32, 3, 4), (None,)),
    *cases("where_promote", lambda x, y: torch.where(x > 0, x.half(), y), two((3, 4), (3, 4)), (None,)),
    *cases("where_nc", transposed(lambda x, y: torch.where(x > 0, x, y)), two((4, 3), (3, 4)), (None,)),
    *cases("where_zero_size", lambda x: torch.where(x > 0, x, 0.0), randn(0, 3), (None,)),
]

CLAMP = [
    *cases("clamp", lambda x: torch.clamp(x, -0.5, 0.5), randn(3, 4), FLOATS),
    *cases("clamp_min_only", lambda x: torch.clamp(x, min=0.1), randn(3, 4), FLOATS),
    *cases("clamp_max_only", lambda x: torch.clamp(x, max=0.1), randn(3, 4), FLOATS),
    *cases("clamp_min", lambda x: torch.clamp_min(x, 0.2), randn(3, 4), FLOATS),
    *cases("clamp_max", lambda x: torch.clamp_max(x, -0.2), randn(3, 4), FLOATS),
    *cases("clamp_tensor", lambda x, lo, hi: torch.clamp(x, lo, lo + hi.abs()), two((3, 4), (4,), (3, 1)), FLOATS),
    *cases("clamp_min_tensor", lambda x, lo: torch.clamp_min(x, lo), two((3, 4), (4,)), FLOATS),
    *cases("clamp_inverted", lambda x: torch.clamp(x, 0.5, -0.5), randn(6), (None,)),
    *cases("clamp_nan", lambda x: torch.clamp(x, -1, 1), specials(), (None,)),
    *cases("clip", lambda x: torch.clip(x, -1, 1), randn(3, 4), (None,)),
    *cases("clamp_int", lambda x: torch.clamp(x, -3, 4), ints(torch.int32, 3, 4), (None,)),
    *cases("clamp_int_float_bound", lambda x: torch.clamp(x, min=0.5), ints(torch.int64, 3, 4), (None,)),
    *cases("clamp_nc", transposed(lambda x: torch.clamp(x, -0.5, 0.5)), randn(4, 3), (None,)),
]


# ----------------------------------------------------------- dynamic shapes
rows, cols = Dim("rows", min=1, max=64), Dim("cols", min=1, max=64)


def _dyn(name, fn, shapes, specs, more_shapes):
    """A row exported with dynamic dims in each float dtype (the half types' programs lowered once
    too), then run at other sizes, a dynamic dim of 1 among them."""
    return cases(name, fn, lambda: tuple(torch.randn(*s) for s in shapes), FLOATS,
                 dynamic_shapes=(specs,),
                 more_inputs=lambda: [tuple(torch.randn(*s) for s in ss) for ss in more_shapes])


DYNAMIC = [
    *_dyn("dyn_exp", torch.exp, [(3, 4)], ({0: rows, 1: cols},), [[(7, 2)], [(1, 9)], [(5, 1)]]),
    *_dyn("dyn_add_bcast", torch.add, [(3, 4), (4,)], ({0: rows, 1: cols}, {0: cols}), [[(5, 6), (6,)], [(1, 1), (1,)]]),
    *_dyn("dyn_where", lambda x, y: torch.where(x > y, x, 0.0), [(3, 4), (3, 4)],
          ({0: rows}, {0: rows}), [[(8, 4), (8, 4)], [(1, 4), (1, 4)]]),
    *_dyn("dyn_clamp", lambda x: torch.clamp(x, -0.3, 0.3) * 2, [(3, 4)], ({1: cols},), [[(3, 11)], [(3, 1)]]),
    *_dyn("dyn_floordiv", lambda x, y: x // y, [(3, 4), (4,)], ({0: rows}, None), [[(6, 4), (4,)], [(1, 4), (4,)]]),
]


CASES = [
    *_unary_cases(), *[c for name, fn, inp in BINARY_FLOAT for c in cases(name, fn, inp, FLOATS)],
    *[c for name, fn in SCALAR_FLOAT for c in cases(name, fn, randn(3, 4), FLOATS)],
    *_int_arith_cases(), *SEMANTICS, *INT_TENSOR_DIVISORS, *REFUSED, *_compare_cases(), *_logic_cases(), *WHERE, *CLAMP, *DYNAMIC,
]
# Half-type rows whose result legitimately differs from the module run in float32 (row: why).
FP32_REFERENCE_DIFFERS = {
    "nan_to_num": "+-inf become the dtype's largest finite value (65504 in fp16, 3.4e38 in float32)",
}
CASES = amend(CASES, FP32_REFERENCE_DIFFERS, fp32_reference=False)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_elementwise(case):
    lower_and_compare(case)


# Not core ATen: EXIR accepts these only when the exporter lists them as exceptions.
NONCORE_OPS = [aten.bitwise_left_shift.Tensor, aten.bitwise_right_shift.Tensor, aten.erfinv.default]


def _shift_amounts(dtype):
    # Out-of-range amounts (negative, >= bit width) are defined by torch: 0 or the sign fill.
    return lambda: (torch.tensor([1, -8, 5, -1, 7, 3, -5, 2], dtype=dtype),
                    torch.tensor([1, 2, 0, 3, -1, 40, 70, 31], dtype=dtype))


NONCORE = [
    *cases("erfinv", torch.erfinv, uniform(-0.8, 0.8, 6), FLOATS),
    *[c for dt in INTS for c in [
        *cases(f"left_shift-{str(dt)[6:]}", torch.bitwise_left_shift, _shift_amounts(dt), (None,)),
        *cases(f"right_shift-{str(dt)[6:]}", torch.bitwise_right_shift, _shift_amounts(dt), (None,)),
    ]],
]


@pytest.mark.parametrize("case", NONCORE, ids=str)
def test_noncore_elementwise(case):
    lower_and_compare(case, keep_ops=NONCORE_OPS)


RAISING = [
    ("remainder", torch.remainder, torch.tensor([3, 0, 2])), ("fmod", torch.fmod, torch.tensor([3, 0, 2])),
    ("floordiv", lambda x, y: x // y, torch.tensor([3, 0, 2])),
    ("truncdiv", lambda x, y: torch.div(x, y, rounding_mode="trunc"), torch.tensor([3, 0, 2])),
]


@pytest.mark.parametrize("name,fn,bad", RAISING, ids=[r[0] for r in RAISING])
def test_integer_division_by_zero_raises(name, fn, bad):
    """torch raises on an integer zero divisor; so does the delegate (MLX alone would not)."""
    x, good = torch.tensor([7, -7, 5]), torch.tensor([2, 3, 1])
    lowered = testing.lower(testing.Lambda(fn), (x, good))
    assert lowered.summary == (1, [])
    method = lowered.method()
    torch.testing.assert_close(method.execute([x, good])[0], fn(x, good))
    with pytest.raises(Exception):
        fn(x, bad)
    with pytest.raises(Exception):
        method.execute([x, bad])
