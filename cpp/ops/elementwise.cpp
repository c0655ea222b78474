// Element-wise families: each op is one row of a table indexed by the
// schema's UnaryOp / BinaryOp enums.
#include <array>
#include <cmath>
#include <functional>
#include <optional>

#include "../ops_common.h"
#include "../stream_wait.h"
#include "kernels/unary_cpu.h"

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
  // max(x, 0) + log1p(exp(-|x|)) never overflows (exp(x) does for x > 11 in fp16). Above torch's
  // threshold (20) the log1p term is below one ulp of x, so the result is x there as in torch.
  return mx::add(mx::maximum(x, scalar_like(0, x)), mx::log1p(mx::exp(mx::negative(mx::abs(x)))));
}

// One row per `enum UnaryOp` value, keyed by it (checked at compile time).
constexpr std::array<OpRow<mlxd::UnaryOp, Unary>, enum_size<mlxd::UnaryOp>()> kUnary = {{
    {mlxd::UnaryOp::Neg, [](const mx::array& x) { return mx::negative(x); }},
    {mlxd::UnaryOp::Abs, [](const mx::array& x) { return mx::abs(x); }},
    {mlxd::UnaryOp::Exp, [](const mx::array& x) { return mx::exp(x); }},
    {mlxd::UnaryOp::Log, [](const mx::array& x) { return mx::log(x); }},
    {mlxd::UnaryOp::Sqrt, [](const mx::array& x) { return mx::sqrt(x); }},
    {mlxd::UnaryOp::Rsqrt, [](const mx::array& x) { return mx::rsqrt(x); }},
    {mlxd::UnaryOp::Sin, [](const mx::array& x) { return mx::sin(x); }},
    {mlxd::UnaryOp::Cos, [](const mx::array& x) { return mx::cos(x); }},
    {mlxd::UnaryOp::Tan, [](const mx::array& x) { return mx::tan(x); }},
    {mlxd::UnaryOp::Tanh, [](const mx::array& x) { return mx::tanh(x); }},
    {mlxd::UnaryOp::Sigmoid, [](const mx::array& x) { return mx::sigmoid(x); }},
    {mlxd::UnaryOp::Relu, [](const mx::array& x) { return mx::maximum(x, scalar_like(0, x)); }},
    {mlxd::UnaryOp::GeluErf, [](const mx::array& x) {  // gelu, erf form
      auto c = scalar_like(M_SQRT1_2, x);
      return mx::multiply(mx::multiply(x, scalar_like(0.5, x)),
                          mx::add(scalar_like(1, x), mx::erf(mx::multiply(x, c))));
    }},
    {mlxd::UnaryOp::GeluTanh, [](const mx::array& x) {  // gelu, tanh form
      auto inner = mx::multiply(scalar_like(std::sqrt(2.0 / M_PI), x),
                                mx::add(x, mx::multiply(scalar_like(0.044715, x), mx::multiply(x, mx::square(x)))));
      return mx::multiply(mx::multiply(x, scalar_like(0.5, x)), mx::add(scalar_like(1, x), mx::tanh(inner)));
    }},
    {mlxd::UnaryOp::Silu, [](const mx::array& x) { return mx::multiply(x, mx::sigmoid(x)); }},
    {mlxd::UnaryOp::Erf, [](const mx::array& x) { return mx::erf(x); }},
    {mlxd::UnaryOp::LogicalNot, [](const mx::array& x) { return mx::logical_not(x); }},
    {mlxd::UnaryOp::Floor, [](const mx::array& x) { return mx::floor(x); }},
    {mlxd::UnaryOp::Ceil, [](const mx::array& x) { return mx::ceil(x); }},
    {mlxd::UnaryOp::Round, [](const mx::array& x) { return mx::round(x); }},
    {mlxd::UnaryOp::Sign, [](const mx::array& x) { return mx::sign(x); }},
    {mlxd::UnaryOp::Square, [](const mx::array& x) { return mx::square(x); }},
    {mlxd::UnaryOp::Reciprocal, [](const mx::array& x) { return mx::reciprocal(x); }},
    {mlxd::UnaryOp::Expm1, [](const mx::array& x) { return mx::expm1(x); }},
    {mlxd::UnaryOp::Log1p, [](const mx::array& x) { return mx::log1p(x); }},
    {mlxd::UnaryOp::Log2, [](const mx::array& x) { return mx::log2(x); }},
    {mlxd::UnaryOp::Log10, [](const mx::array& x) { return mx::log10(x); }},
    {mlxd::UnaryOp::Asin, [](const mx::array& x) { return mx::arcsin(x); }},
    {mlxd::UnaryOp::Acos, [](const mx::array& x) { return mx::arccos(x); }},
    {mlxd::UnaryOp::Atan, [](const mx::array& x) { return mx::arctan(x); }},
    {mlxd::UnaryOp::Sinh, [](const mx::array& x) { return mx::sinh(x); }},
    {mlxd::UnaryOp::Cosh, [](const mx::array& x) { return mx::cosh(x); }},
    {mlxd::UnaryOp::Asinh, [](const mx::array& x) { return mx::arcsinh(x); }},
    {mlxd::UnaryOp::Acosh, [](const mx::array& x) { return mx::arccosh(x); }},
    {mlxd::UnaryOp::Atanh, [](const mx::array& x) { return mx::arctanh(x); }},
    {mlxd::UnaryOp::IsNan, [](const mx::array& x) { return mx::isnan(x); }},
    {mlxd::UnaryOp::IsInf, [](const mx::array& x) { return mx::isinf(x); }},
    {mlxd::UnaryOp::BitwiseNot, [](const mx::array& x) { return x.dtype() == mx::bool_ ? mx::logical_not(x) : mx::bitwise_invert(x); }},
    {mlxd::UnaryOp::Softplus, [](const mx::array& x) { return softplus(x); }},
    {mlxd::UnaryOp::Mish, [](const mx::array& x) { return mx::multiply(x, mx::tanh(softplus(x))); }},
    {mlxd::UnaryOp::Hardswish, [](const mx::array& x) { return mx::multiply(x, relu6_shift(x)); }},
    {mlxd::UnaryOp::Hardsigmoid, [](const mx::array& x) { return relu6_shift(x); }},
    {mlxd::UnaryOp::Trunc, [](const mx::array& x) { return mx::issubdtype(x.dtype(), mx::floating) ? mx::trunc(x) : x; }},
    {mlxd::UnaryOp::IsFinite, [](const mx::array& x) { return mx::isfinite(x); }},
    {mlxd::UnaryOp::Erfinv, [](const mx::array& x) { return mx::erfinv(x); }},
    {mlxd::UnaryOp::IsPosInf, [](const mx::array& x) { return mx::isposinf(x); }},
    {mlxd::UnaryOp::IsNegInf, [](const mx::array& x) { return mx::isneginf(x); }},
}};
static_assert(rows_follow_enum(kUnary), "kUnary: one row per UnaryOp, in the schema's order");

bool is_float(const mx::array& x) { return mx::issubdtype(x.dtype(), mx::floating); }

// torch raises on an integer zero divisor, where MLX returns an arbitrary number. Checking
// evaluates the divisor early: cheap for the usual constant one.
const mx::array& nonzero_divisor(const mx::array& b) {
  if (is_float(b)) return b;
  mx::array zero = mx::any(mx::equal(b, scalar_like(0, b)));
  eval_follow_up({zero});  // ahead of the stream's linger (stream_wait.h)
  if (zero.item<bool>())
    throw NodeError("ZeroDivisionError: integer division or remainder by zero");
  return b;
}

// torch's integer pow: a negative exponent gives 0, except for bases 1 and -1 (C++ would
// divide by zero in the power loop).
mx::array torch_power(const mx::array& a, const mx::array& b) {
  if (is_float(a) || is_float(b) || a.dtype() == mx::bool_) return mx::power(a, b);
  auto zero = scalar_like(0, b), one = scalar_like(1, a);
  auto positive = mx::power(a, mx::maximum(b, zero));
  auto odd = mx::not_equal(mx::remainder(b, scalar_like(2, b)), zero);
  auto unit = mx::where(mx::equal(a, one), one,
                        mx::where(mx::equal(a, scalar_like(-1, a)), mx::where(odd, scalar_like(-1, a), one),
                                  scalar_like(0, a)));
  return mx::where(mx::less(b, zero), unit, positive);
}

// fp16/bf16 divisions run in fp32 like torch's: rounding the quotient to 16 bits first can move
// it across an integer and change the floor/trunc.
template <typename F>
mx::array in_fp32(const mx::array& a, const mx::array& b, F f) {
  auto dt = a.dtype();
  if (dt != mx::float16 && dt != mx::bfloat16) return f(a, b);
  return mx::astype(f(mx::astype(a, mx::float32), mx::astype(b, mx::float32)), dt);
}

mx::array fmod(const mx::array& a, const mx::array& b) {
  // C fmod (sign of the dividend). On non-negative operands MLX's remainder is exactly fmod.
  return mx::multiply(mx::sign(a), mx::remainder(mx::abs(a), mx::abs(b)));
}

// torch's div_floor_floating: (a - fmod(a, b)) / b corrected to the floor, which is exact where
// floor(a / b) is not (1.0 // 0.1 is 9, but 1.0 / 0.1 rounds to 10).
mx::array floor_divide_float(const mx::array& a, const mx::array& b) {
  auto zero = scalar_like(0, a), one = scalar_like(1, a);
  auto mod = fmod(a, b);
  auto div = mx::divide(mx::subtract(a, mod), b);
  auto off = mx::logical_and(mx::not_equal(mod, zero), mx::not_equal(mx::less(b, zero), mx::less(mod, zero)));
  div = mx::subtract(div, mx::astype(off, a.dtype()));
  auto fl = mx::floor(div);
  fl = mx::add(fl, mx::astype(mx::greater(mx::subtract(div, fl), scalar_like(0.5, a)), a.dtype()));
  auto quotient = mx::divide(a, b);
  fl = mx::where(mx::equal(div, zero), mx::multiply(zero, quotient), fl);  // signed zero, as torch
  return mx::where(mx::equal(b, zero), quotient, fl);
}

mx::array torch_floor_divide(const mx::array& a, const mx::array& b) {
  return is_float(a) ? in_fp32(a, b, floor_divide_float) : mx::floor_divide(a, b);
}

mx::array trunc_divide(const mx::array& a, const mx::array& b) {
  if (is_float(a)) return in_fp32(a, b, [](const mx::array& x, const mx::array& y) { return mx::trunc(mx::divide(x, y)); });
  // Integers: the floor quotient is one below the truncated one when the signs differ and the
  // division is inexact.
  auto zero = scalar_like(0, a);
  auto inexact = mx::not_equal(mx::remainder(a, b), zero);
  auto signs_differ = mx::not_equal(mx::less(a, zero), mx::less(b, zero));
  return mx::add(mx::floor_divide(a, b), mx::astype(mx::logical_and(inexact, signs_differ), a.dtype()));
}

int bit_width(const mx::array& x) { return static_cast<int>(x.itemsize() * 8); }

// torch defines shifts by a negative amount or by the bit width or more (C++ leaves them
// undefined): left gives 0, right gives the sign fill.
mx::array out_of_range_shift(const mx::array& s, const mx::array& x) {
  return mx::logical_or(mx::less(s, scalar_like(0, s)), mx::greater_equal(s, scalar_like(bit_width(x), s)));
}

mx::array safe_shift(const mx::array& s, const mx::array& x) {
  return mx::clip(s, scalar_like(0, s), scalar_like(bit_width(x) - 1, s));
}

mx::array torch_left_shift(const mx::array& a, const mx::array& b) {
  return mx::where(out_of_range_shift(b, a), scalar_like(0, a), mx::left_shift(a, safe_shift(b, a)));
}

mx::array torch_right_shift(const mx::array& a, const mx::array& b) {
  auto fill = mx::where(mx::less(a, scalar_like(0, a)), scalar_like(-1, a), scalar_like(0, a));
  return mx::where(out_of_range_shift(b, a), fill, mx::right_shift(a, safe_shift(b, a)));
}

// One row per `enum BinaryOp` value, keyed by it (checked at compile time).
constexpr std::array<OpRow<mlxd::BinaryOp, Binary>, enum_size<mlxd::BinaryOp>()> kBinary = {{
    {mlxd::BinaryOp::Add, [](const mx::array& a, const mx::array& b) { return mx::add(a, b); }},
    {mlxd::BinaryOp::Sub, [](const mx::array& a, const mx::array& b) { return mx::subtract(a, b); }},
    {mlxd::BinaryOp::Mul, [](const mx::array& a, const mx::array& b) { return mx::multiply(a, b); }},
    {mlxd::BinaryOp::Div, [](const mx::array& a, const mx::array& b) { return mx::divide(a, b); }},
    {mlxd::BinaryOp::Pow, [](const mx::array& a, const mx::array& b) { return torch_power(a, b); }},
    {mlxd::BinaryOp::Maximum, [](const mx::array& a, const mx::array& b) { return mx::maximum(a, b); }},
    {mlxd::BinaryOp::Minimum, [](const mx::array& a, const mx::array& b) { return mx::minimum(a, b); }},
    {mlxd::BinaryOp::Equal, [](const mx::array& a, const mx::array& b) { return mx::equal(a, b); }},
    {mlxd::BinaryOp::NotEqual, [](const mx::array& a, const mx::array& b) { return mx::not_equal(a, b); }},
    {mlxd::BinaryOp::Less, [](const mx::array& a, const mx::array& b) { return mx::less(a, b); }},
    {mlxd::BinaryOp::LessEqual, [](const mx::array& a, const mx::array& b) { return mx::less_equal(a, b); }},
    {mlxd::BinaryOp::Greater, [](const mx::array& a, const mx::array& b) { return mx::greater(a, b); }},
    {mlxd::BinaryOp::GreaterEqual, [](const mx::array& a, const mx::array& b) { return mx::greater_equal(a, b); }},
    {mlxd::BinaryOp::LogicalAnd, [](const mx::array& a, const mx::array& b) { return mx::logical_and(a, b); }},
    {mlxd::BinaryOp::LogicalOr, [](const mx::array& a, const mx::array& b) { return mx::logical_or(a, b); }},
    {mlxd::BinaryOp::LogicalXor, [](const mx::array& a, const mx::array& b) {
      return mx::not_equal(mx::astype(a, mx::bool_), mx::astype(b, mx::bool_));
    }},
    {mlxd::BinaryOp::BitwiseAnd, [](const mx::array& a, const mx::array& b) { return mx::bitwise_and(a, b); }},
    {mlxd::BinaryOp::BitwiseOr, [](const mx::array& a, const mx::array& b) { return mx::bitwise_or(a, b); }},
    {mlxd::BinaryOp::BitwiseXor, [](const mx::array& a, const mx::array& b) { return mx::bitwise_xor(a, b); }},
    {mlxd::BinaryOp::Remainder, [](const mx::array& a, const mx::array& b) { return mx::remainder(a, nonzero_divisor(b)); }},
    {mlxd::BinaryOp::FloorDivide, [](const mx::array& a, const mx::array& b) { return torch_floor_divide(a, nonzero_divisor(b)); }},
    {mlxd::BinaryOp::Atan2, [](const mx::array& a, const mx::array& b) { return mx::arctan2(a, b); }},
    {mlxd::BinaryOp::LogAddExp, [](const mx::array& a, const mx::array& b) { return mx::logaddexp(a, b); }},
    {mlxd::BinaryOp::LeftShift, [](const mx::array& a, const mx::array& b) { return torch_left_shift(a, b); }},
    {mlxd::BinaryOp::RightShift, [](const mx::array& a, const mx::array& b) { return torch_right_shift(a, b); }},
    {mlxd::BinaryOp::Fmod, [](const mx::array& a, const mx::array& b) { return fmod(a, nonzero_divisor(b)); }},
    {mlxd::BinaryOp::TruncDivide, [](const mx::array& a, const mx::array& b) { return trunc_divide(a, nonzero_divisor(b)); }},
}};
static_assert(rows_follow_enum(kBinary), "kBinary: one row per BinaryOp, in the schema's order");

}  // namespace

// Ops with a CPU kernel (kernels/unary_cpu.h): MLX's CPU versions are one
// scalar libm call per element on one core.
std::optional<UnaryKernel> cpu_kernel_for(mlxd::UnaryOp op) {
  switch (op) {
    case mlxd::UnaryOp::Exp: return UnaryKernel::exp;
    case mlxd::UnaryOp::Sigmoid: return UnaryKernel::sigmoid;
    case mlxd::UnaryOp::Silu: return UnaryKernel::silu;
    case mlxd::UnaryOp::GeluErf: return UnaryKernel::gelu_erf;
    case mlxd::UnaryOp::GeluTanh: return UnaryKernel::gelu_tanh;
    case mlxd::UnaryOp::Erf: return UnaryKernel::erf;
    case mlxd::UnaryOp::Hardswish: return UnaryKernel::hardswish;
    case mlxd::UnaryOp::Hardsigmoid: return UnaryKernel::hardsigmoid;
    default: return std::nullopt;
  }
}

mx::array unary_op(mlxd::UnaryOp op, const mx::array& x, const std::optional<mx::array>& bias) {
  const auto& fn = table_at(kUnary, op, "unary op");
  if (auto kernel = cpu_kernel_for(op); kernel && unary_cpu_applies(x, bias)) return unary_cpu(x, *kernel, bias);
  return fn(bias ? mx::add(x, *bias) : x);
}

void exec_UnaryNode(const mlxd::UnaryNode& n, ExecContext& ctx) { ctx.set(n.out(), unary_op(n.op(), ctx.in(n.x()))); }

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
