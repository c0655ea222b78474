// Gathers: take (embedding, index_select) and take_along_axis (gather).
#include "../ops_common.h"

namespace mlxd::rt {

void exec_TakeNode(const mlxd::TakeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  ctx.set(n.out(), mx::take(x, ctx.in(n.indices()), normalize_axis(n.axis(), x.ndim())));
}

void exec_TakeAlongAxisNode(const mlxd::TakeAlongAxisNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  ctx.set(n.out(), mx::take_along_axis(x, ctx.in(n.indices()), normalize_axis(n.axis(), x.ndim())));
}

}  // namespace mlxd::rt
