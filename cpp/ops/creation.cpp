// Tensors created from scalars: full, arange.
#include <cmath>

#include "../ops_common.h"

namespace mlxd::rt {

void exec_FullNode(const mlxd::FullNode& n, ExecContext& ctx) {
  auto dtype = to_mlx(n.dtype());
  ctx.set(n.out(), mx::full(ctx.resolve_shape(n.shape()), mx::array(ctx.resolve(n.value()), dtype), dtype));
}

void exec_ArangeNode(const mlxd::ArangeNode& n, ExecContext& ctx) {
  double start = ctx.resolve(n.start()), stop = ctx.resolve(n.stop()), step = ctx.resolve(n.step());
  if (step == 0 || !std::isfinite(start) || !std::isfinite(stop)) throw NodeError("bad arange bounds");
  ctx.set(n.out(), mx::arange(start, stop, step, to_mlx(n.dtype())));
}

}  // namespace mlxd::rt
