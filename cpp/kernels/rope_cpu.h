// Rotary position embedding (RoPE) on the CPU as one MLX primitive. MLX has no
// CPU kernel for mx::fast::rope: it composes positions, frequencies, cos, sin,
// slices, products and a concatenate (a dozen graph nodes) on every call,
// which is most of a decode step's RoPE cost. This kernel computes the same
// values in one node: the cos / sin table once per (position, frequency),
// shared by every head, math in float32.
#pragma once

#include <optional>
#include <variant>

#include <mlx/mlx.h>

namespace mlxd::rt {

// The first position: a constant, or a one-element integer array read when
// the node runs (the graph then does not depend on the position).
using RopeOffset = std::variant<int, mlx::core::array>;

// Whether rope_cpu takes x (and the optional frequencies): kernels on
// (cpu_kernels_active), non-empty float32 / bfloat16 / float16 x of rank >= 2,
// and inv_freq (when given) float32 / bfloat16 / float16.
bool rope_cpu_applies(const mlx::core::array& x, const mlx::core::array* inv_freq = nullptr);

// What mx::fast::rope(x, dims, traditional, base, scale, offset, 1 / inv_freq)
// computes, for x [..., L, D] (any leading axes and strides): the first `dims`
// features at positions offset .. offset + L - 1 are rotated, in interleaved
// pairs (traditional) or as two halves, the rest copied. Frequencies:
// base ** (-2i / dims) when inv_freq is absent, else inv_freq [dims / 2].
// The result has x's shape and dtype.
mlx::core::array rope_cpu(const mlx::core::array& x, int dims, bool traditional, float base, float scale,
                          const RopeOffset& offset, const std::optional<mlx::core::array>& inv_freq);

}  // namespace mlxd::rt
