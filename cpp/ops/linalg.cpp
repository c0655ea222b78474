// Matrix products.
#include "../ops_common.h"

namespace mlxd::rt {

void exec_MatmulNode(const mlxd::MatmulNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::matmul(ctx.in(n.a()), ctx.in(n.b())));
}

void exec_LinearNode(const mlxd::LinearNode& n, ExecContext& ctx) {
  const auto& w = ctx.in(n.weight());
  if (w.ndim() != 2) throw NodeError("linear weight must be 2-D");
  auto y = mx::matmul(ctx.in(n.x()), mx::transpose(w));
  if (auto* b = ctx.maybe_in(n.bias())) y = mx::add(y, *b);
  ctx.set(n.out(), y);
}

void exec_AddmmNode(const mlxd::AddmmNode& n, ExecContext& ctx) {
  const auto& a = ctx.in(n.a());
  if (n.beta() == 0) {  // torch ignores c entirely then (NaN/inf in c must not leak through 0 * c)
    auto y = mx::matmul(a, ctx.in(n.b()));
    if (n.alpha() != 1) y = mx::multiply(y, mx::array(n.alpha(), y.dtype()));
    ctx.set(n.out(), mx::broadcast_to(y, mx::broadcast_shapes(y.shape(), ctx.in(n.c()).shape())));
    return;
  }
  ctx.set(n.out(), mx::addmm(ctx.in(n.c()), a, ctx.in(n.b()), static_cast<float>(n.alpha()),
                             static_cast<float>(n.beta())));
}

}  // namespace mlxd::rt
