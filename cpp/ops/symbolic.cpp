// Scalar value slots: dynamic sizes, sym-int arithmetic, item(), asserts.
#include <cmath>

#include "../ops_common.h"
#include "../stream_wait.h"

namespace mlxd::rt {

void exec_SymSizeNode(const mlxd::SymSizeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  ctx.set_value(n.out(), int64_t(x.shape(normalize_axis(n.dim(), x.ndim()))));
}

namespace {
template <typename T>
T floordiv(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    if (b == 0) throw NodeError("integer division by zero");
    T q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
  } else {
    return std::floor(a / b);
  }
}

template <typename T>
Value apply(mlxd::ScalarOp op, T a, T b) {
  switch (op) {
    case mlxd::ScalarOp::Add: return a + b;
    case mlxd::ScalarOp::Sub: return a - b;
    case mlxd::ScalarOp::Mul: return a * b;
    case mlxd::ScalarOp::FloorDiv: return floordiv(a, b);
    case mlxd::ScalarOp::Mod: return a - floordiv(a, b) * b;
    case mlxd::ScalarOp::Max: return std::max(a, b);
    case mlxd::ScalarOp::Min: return std::min(a, b);
    case mlxd::ScalarOp::TrueDiv: return static_cast<double>(a) / static_cast<double>(b);
    case mlxd::ScalarOp::Neg: return -a;
    case mlxd::ScalarOp::Eq: return int64_t(a == b);
    case mlxd::ScalarOp::Ne: return int64_t(a != b);
    case mlxd::ScalarOp::Lt: return int64_t(a < b);
    case mlxd::ScalarOp::Le: return int64_t(a <= b);
    case mlxd::ScalarOp::Gt: return int64_t(a > b);
    case mlxd::ScalarOp::Ge: return int64_t(a >= b);
  }
  throw NodeError("unknown scalar op");
}

int64_t resolve_int(const ExecContext& ctx, const mlxd::FloatOrVid* v) {
  if (v == nullptr) return 0;
  return v->vid() < 0 ? static_cast<int64_t>(v->literal()) : ctx.int_value(static_cast<uint32_t>(v->vid()));
}
}  // namespace

void exec_ScalarOpNode(const mlxd::ScalarOpNode& n, ExecContext& ctx) {
  if (n.is_int()) {
    ctx.set_value(n.out(), apply<int64_t>(n.op(), resolve_int(ctx, n.a()), resolve_int(ctx, n.b())));
  } else {
    double b = n.b() ? ctx.resolve(n.b()) : 0.0;
    ctx.set_value(n.out(), apply<double>(n.op(), ctx.resolve(n.a()), b));
  }
}

void exec_ItemNode(const mlxd::ItemNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  if (x.size() != 1) throw NodeError("item() needs a one-element tensor");
  // Evaluated ahead of the stream's linger (stream_wait.h), not behind it.
  mx::array v = mx::astype(x, mx::issubdtype(x.dtype(), mx::floating) ? mx::float32 : mx::int64);
  eval_follow_up({v});
  if (v.dtype() == mx::float32) ctx.set_value(n.out(), static_cast<double>(v.item<float>()));
  else ctx.set_value(n.out(), v.item<int64_t>());
}

void exec_AssertNode(const mlxd::AssertNode& n, ExecContext& ctx) {
  if (!n.cond()) throw NodeError("assert without a condition");
  if (ctx.int_value(n.cond()->idx()) == 0)
    throw std::invalid_argument(n.message() ? printable(std::string_view(n.message()->c_str(), n.message()->size())) : std::string("runtime assertion failed"));
}

}  // namespace mlxd::rt
