// Element-wise families: each op is one row of a table indexed by the
// schema's UnaryOp / BinaryOp enums.
#include <array>
#include <cmath>
#include <functional>

#include "../ops_common.h"

namespace mlxd::rt {
namespace {

using Unary = mx::array (*)(const mx::array&);
using Binary = mx::array (*)(const mx::array&, const mx::array&);

mx::array scalar_like(double v, const mx::array& x) { return mx::array(v, x.dtype()); }

mx::array relu6_shift(const mx::array& x) {  // relu6(x + 3) / 6
  auto y = mx::minimum(mx::maximum(mx::add(x, scalar_like(3, x)), scalar_like(0, x)), scalar_like(6, x));
  return mx::divide(y, scalar_like(6, x));
}

mx::array softplus(const mx::array& x) {
  // torch's default threshold (20): linear above it, log1p(exp(x)) below.
  auto thr = mx::greater(x, scalar_like(20, x));
  return mx::where(thr, x, mx::log1p(mx::exp(mx::minimum(x, scalar_like(20, x)))));
}

// Rows must follow the order of `enum UnaryOp` in the schema.
const std::array<Unary, static_cast<size_t>(mlxd::UnaryOp::MAX) + 1> kUnary = {
    [](const mx::array& x) { return mx::negative(x); },
    [](const mx::array& x) { return mx::abs(x); },
    [](const mx::array& x) { return mx::exp(x); },
    [](const mx::array& x) { return mx::log(x); },
    [](const mx::array& x) { return mx::sqrt(x); },
    [](const mx::array& x) { return mx::rsqrt(x); },
    [](const mx::array& x) { return mx::sin(x); },
    [](const mx::array& x) { return mx::cos(x); },
    [](const mx::array& x) { return mx::tan(x); },
    [](const mx::array& x) { return mx::tanh(x); },
    [](const mx::array& x) { return mx::sigmoid(x); },
    [](const mx::array& x) { return mx::maximum(x, scalar_like(0, x)); },
    [](const mx::array& x) {  // gelu, erf form
      auto c = scalar_like(M_SQRT1_2, x);
      return mx::multiply(mx::multiply(x, scalar_like(0.5, x)),
                          mx::add(scalar_like(1, x), mx::erf(mx::multiply(x, c))));
    },
    [](const mx::array& x) {  // gelu, tanh form
      auto inner = mx::multiply(scalar_like(std::sqrt(2.0 / M_PI), x),
                                mx::add(x, mx::multiply(scalar_like(0.044715, x), mx::multiply(x, mx::square(x)))));
      return mx::multiply(mx::multiply(x, scalar_like(0.5, x)), mx::add(scalar_like(1, x), mx::tanh(inner)));
    },
    [](const mx::array& x) { return mx::multiply(x, mx::sigmoid(x)); },
    [](const mx::array& x) { return mx::erf(x); },
    [](const mx::array& x) { return mx::logical_not(x); },
    [](const mx::array& x) { return mx::floor(x); },
    [](const mx::array& x) { return mx::ceil(x); },
    [](const mx::array& x) { return mx::round(x); },
    [](const mx::array& x) { return mx::sign(x); },
    [](const mx::array& x) { return mx::square(x); },
    [](const mx::array& x) { return mx::reciprocal(x); },
    [](const mx::array& x) { return mx::expm1(x); },
    [](const mx::array& x) { return mx::log1p(x); },
    [](const mx::array& x) { return mx::log2(x); },
    [](const mx::array& x) { return mx::log10(x); },
    [](const mx::array& x) { return mx::arcsin(x); },
    [](const mx::array& x) { return mx::arccos(x); },
    [](const mx::array& x) { return mx::arctan(x); },
    [](const mx::array& x) { return mx::sinh(x); },
    [](const mx::array& x) { return mx::cosh(x); },
    [](const mx::array& x) { return mx::arcsinh(x); },
    [](const mx::array& x) { return mx::arccosh(x); },
    [](const mx::array& x) { return mx::arctanh(x); },
    [](const mx::array& x) { return mx::isnan(x); },
    [](const mx::array& x) { return mx::isinf(x); },
    [](const mx::array& x) { return x.dtype() == mx::bool_ ? mx::logical_not(x) : mx::bitwise_invert(x); },
    [](const mx::array& x) { return softplus(x); },
    [](const mx::array& x) { return mx::multiply(x, mx::tanh(softplus(x))); },
    [](const mx::array& x) { return mx::multiply(x, relu6_shift(x)); },
    [](const mx::array& x) { return relu6_shift(x); },
    [](const mx::array& x) { return mx::issubdtype(x.dtype(), mx::floating) ? mx::trunc(x) : x; },
    [](const mx::array& x) { return mx::isfinite(x); },
    [](const mx::array& x) { return mx::erfinv(x); },
    [](const mx::array& x) { return mx::isposinf(x); },
    [](const mx::array& x) { return mx::isneginf(x); },
};

mx::array fmod(const mx::array& a, const mx::array& b) {
  // C fmod: the result takes the sign of the dividend.
  auto r = mx::remainder(a, b);
  auto zero = scalar_like(0, r);
  auto fix = mx::logical_and(mx::not_equal(r, zero), mx::not_equal(mx::less(r, zero), mx::less(a, zero)));
  return mx::where(fix, mx::subtract(r, b), r);
}

// Rows must follow the order of `enum BinaryOp` in the schema.
const std::array<Binary, static_cast<size_t>(mlxd::BinaryOp::MAX) + 1> kBinary = {
    [](const mx::array& a, const mx::array& b) { return mx::add(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::subtract(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::multiply(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::divide(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::power(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::maximum(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::minimum(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::equal(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::not_equal(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::less(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::less_equal(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::greater(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::greater_equal(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::logical_and(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::logical_or(a, b); },
    [](const mx::array& a, const mx::array& b) {
      return mx::not_equal(mx::astype(a, mx::bool_), mx::astype(b, mx::bool_));
    },
    [](const mx::array& a, const mx::array& b) { return mx::bitwise_and(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::bitwise_or(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::bitwise_xor(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::remainder(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::floor_divide(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::arctan2(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::logaddexp(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::left_shift(a, b); },
    [](const mx::array& a, const mx::array& b) { return mx::right_shift(a, b); },
    [](const mx::array& a, const mx::array& b) { return fmod(a, b); },
};

}  // namespace

void exec_UnaryNode(const mlxd::UnaryNode& n, ExecContext& ctx) {
  ctx.set(n.out(), table_at(kUnary, n.op(), "unary op")(ctx.in(n.x())));
}

void exec_BinaryNode(const mlxd::BinaryNode& n, ExecContext& ctx) {
  ctx.set(n.out(), table_at(kBinary, n.op(), "binary op")(ctx.in(n.a()), ctx.in(n.b())));
}

void exec_WhereNode(const mlxd::WhereNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::where(ctx.in(n.cond()), ctx.in(n.a()), ctx.in(n.b())));
}

void exec_ClipNode(const mlxd::ClipNode& n, ExecContext& ctx) {
  mx::array x = ctx.in(n.x());
  if (auto* lo = ctx.maybe_in(n.lo())) x = mx::maximum(x, *lo);
  if (auto* hi = ctx.maybe_in(n.hi())) x = mx::minimum(x, *hi);
  ctx.set(n.out(), x);
}

}  // namespace mlxd::rt
