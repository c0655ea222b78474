// Tensors created from scalars: full, full_like, arange.
#include <algorithm>
#include <cmath>
#include <limits>

#include "../ops_common.h"

namespace mlxd::rt {

void exec_FullNode(const mlxd::FullNode& n, ExecContext& ctx) {
  auto dtype = to_mlx(n.dtype());
  ctx.set(n.out(), mx::full(ctx.resolve_shape(n.shape()), mx::array(ctx.resolve(n.value()), dtype), dtype));
}

void exec_ArangeNode(const mlxd::ArangeNode& n, ExecContext& ctx) {
  double start = ctx.resolve(n.start()), stop = ctx.resolve(n.stop()), step = ctx.resolve(n.step());
  if (step == 0 || !std::isfinite(start) || !std::isfinite(stop)) throw NodeError("bad arange bounds");
  auto dtype = to_mlx(n.dtype());
  if (!mx::issubdtype(dtype, mx::floating)) return ctx.set(n.out(), mx::arange(start, stop, step, dtype));
  // Floating ranges as start + i * step in float32, rounded once to the dtype, like torch;
  // MLX's own float arange drifts by tens of ulps over a few hundred elements.
  double count = std::max(0.0, std::ceil((stop - start) / step));
  if (count > std::numeric_limits<int32_t>::max()) throw NodeError("arange too long");
  auto i = mx::arange(0, static_cast<int>(count), mx::float32);
  auto r = mx::add(mx::multiply(i, mx::array(static_cast<float>(step))), mx::array(static_cast<float>(start)));
  ctx.set(n.out(), mx::astype(r, dtype));
}

void exec_FullLikeNode(const mlxd::FullLikeNode& n, ExecContext& ctx) {
  auto dtype = to_mlx(n.dtype());
  ctx.set(n.out(), mx::full(ctx.in(n.x()).shape(), mx::array(ctx.resolve(n.value()), dtype), dtype));
}

}  // namespace mlxd::rt
