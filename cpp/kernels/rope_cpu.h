// Rotary position embedding (RoPE) on the CPU as one MLX primitive. MLX has no
// CPU kernel for mx::fast::rope: it composes positions, frequencies, cos, sin,
// slices, products and a concatenate (a dozen graph nodes) on every call,
// which is most of a decode step's RoPE cost. This kernel computes the same
// values in one node: the cos / sin table once per (position, frequency),
// shared by every head, math in float32.
#pragma once

#include <optional>
#include <variant>
#include <vector>

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

// rope_cpu's pieces, for kernels that rotate rows inside their own task
// (rope_kv_cpu): element 0 of an integer array (a position); MLX's float32
// inverse frequencies (from base, or `freqs` of freqs_type at freqs_stride);
// the cos / sin table [L, inv.size()] of positions first .. first + L - 1
// (times scale); one row's rotation of its first 2 * half features, x -> y
// (y may be x).
int64_t rope_read_position(const void* p, mlx::core::Dtype t);
std::vector<float> rope_inverse_frequencies(int dims, float base, const void* freqs, mlx::core::Dtype freqs_type,
                                            int64_t freqs_stride);
void rope_angle_table(int64_t L, int64_t first, float scale, const std::vector<float>& inv, std::vector<float>& cos_t,
                      std::vector<float>& sin_t);
void rope_rotate_row(const float* x, float* y, const float* cos_r, const float* sin_r, int half, bool traditional);

}  // namespace mlxd::rt
