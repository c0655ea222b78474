// One attention layer's RoPE and KV-cache writes on the CPU as one MLX
// primitive with three outputs: q rotated, and the k and v caches with k
// rotated and v written at an array offset. Composed, a decode step spends two
// RoPE primitives and two slice updates (each with the cast, reshape and clamp
// of its start) per layer on a handful of rows; here the caches are updated in
// place (donated, as MLX's slice update does when nothing else reads them) and
// the rows are rotated and stored in one task.
#pragma once

#include <array>
#include <optional>

#include <mlx/mlx.h>

namespace mlxd::rt {

struct RopeKvWriteArgs {
  int dims;
  bool traditional;
  float base;       // used when inv_freq is absent
  bool seq_first;   // q, k, v given as [B, L, H, D] (read as their transposes)
};

// a's shape as [B, H, L, D]: a's own, or with axes 1 and 2 swapped when seq_first.
mlx::core::Shape heads_first_shape(const mlx::core::array& a, bool seq_first);

// Whether rope_kv_write_cpu takes the operands: kernels on (cpu_kernels_active);
// q [B, Hq, L, D], k [B, Hk, L, D], v [B, Hk, L, Dv] (as heads_first_shape reads them), caches [B, Hk, S, D] and
// [B, Hk, S, Dv] with L <= S; q / k / v and the caches one float dtype
// (float32 / bfloat16 / float16); inv_freq (when given) floating.
bool rope_kv_write_cpu_applies(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                               const mlx::core::array& k_cache, const mlx::core::array& v_cache,
                               const mlx::core::array* inv_freq, bool seq_first);

// {rope(q), k_cache with rope(k) at write_pos, v_cache with v at write_pos}:
// what mx::fast::rope at rope_pos and two slice updates at write_pos clamped
// to [0, S - L] compute (q's result [B, Hq, L, D]). rope_pos / write_pos: one-element integer arrays, read
// when the node runs. Any input strides; outputs row-major. When q, k and v (seq_first) are reshaped
// last-axis slices of one [B, L, N] array (a fused q/k/v projection), the primitive reads them from
// that array, and the slices and reshapes leave the graph (counter "rope_kv_write_packed").
std::array<mlx::core::array, 3> rope_kv_write_cpu(const mlx::core::array& q, const mlx::core::array& k,
                                                  const mlx::core::array& v, const mlx::core::array& k_cache,
                                                  const mlx::core::array& v_cache, const mlx::core::array& rope_pos,
                                                  const mlx::core::array& write_pos,
                                                  const std::optional<mlx::core::array>& inv_freq,
                                                  const RopeKvWriteArgs& args);

// Reading packed q / k / v from their projection: on by default; off keeps the slices and reshapes in the
// graph (A/B timings). Read when a graph is built.
void rope_kv_write_cpu_set_packed(bool on);

}  // namespace mlxd::rt
