// Normalisations, mapped to MLX's fused kernels.
#include <mlx/fast.h>

#include "../ops_common.h"

namespace mlxd::rt {

namespace {
std::optional<mx::array> optional_in(ExecContext& ctx, const mlxd::Tid* t) {
  if (auto* a = ctx.maybe_in(t)) return *a;
  return std::nullopt;
}
}  // namespace

void exec_LayerNormNode(const mlxd::LayerNormNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::fast::layer_norm(ctx.in(n.x()), optional_in(ctx, n.weight()), optional_in(ctx, n.bias()),
                                        n.eps()));
}

void exec_RmsNormNode(const mlxd::RmsNormNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::fast::rms_norm(ctx.in(n.x()), optional_in(ctx, n.weight()), n.eps()));
}

}  // namespace mlxd::rt
