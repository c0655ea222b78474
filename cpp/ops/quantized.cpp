// Weight-only quantized products in MLX's affine format: packed unsigned
// weights (stored as int32 words, viewed as uint32 here) with per-group scales
// and biases, w = scales * q + biases along the last axis.
#include "../ops_common.h"

namespace mlxd::rt {
namespace {

// The payload stores the packed words as int32 (torch has no usable uint32);
// MLX's quantized kernels read them as uint32. A view, not a copy.
mx::array packed_words(const mx::array& w) {
  if (w.dtype() != mx::int32 && w.dtype() != mx::uint32) throw NodeError("packed weights must be 32-bit words");
  if (w.ndim() != 2) throw NodeError("packed weights must be 2-D");
  return w.dtype() == mx::uint32 ? w : mx::view(w, mx::uint32);
}

}  // namespace

void exec_QuantizedLinearNode(const mlxd::QuantizedLinearNode& n, ExecContext& ctx) {
  auto y = mx::quantized_matmul(ctx.in(n.x()), packed_words(ctx.in(n.w())), ctx.in(n.scales()),
                                ctx.in(n.biases()), /*transpose=*/true, n.group_size(), n.bits(), "affine");
  if (auto* b = ctx.maybe_in(n.bias())) y = mx::add(y, *b);
  ctx.set(n.out(), y);
}

// Gathers the packed rows with their scales and biases, then dequantizes only those.
void exec_QuantizedEmbeddingNode(const mlxd::QuantizedEmbeddingNode& n, ExecContext& ctx) {
  const auto& idx = ctx.in(n.indices());
  auto flat = mx::flatten(idx);
  auto rows = [&](const mx::array& a) { return mx::take(a, flat, 0); };
  const auto& scales = ctx.in(n.scales());
  auto y = mx::dequantize(rows(packed_words(ctx.in(n.w()))), rows(scales), rows(ctx.in(n.biases())),
                          n.group_size(), n.bits(), "affine", std::nullopt, scales.dtype());
  auto shape = idx.shape();
  shape.push_back(y.shape(-1));
  ctx.set(n.out(), mx::reshape(y, shape));
}

}  // namespace mlxd::rt
