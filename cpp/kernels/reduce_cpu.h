// Sum, mean, max and min over the trailing axes on the CPU, as one MLX primitive: x is read as rows of
// the reduced axes' elements, float32 / bfloat16 / float16 in, the same dtype out, sums in float64,
// split across the kernel pool. MLX's CPU reductions of contiguous elements add one at a time on one
// core (a [64, 4096] amax: ~220 us against ~50; a [1, 3, 224, 224] mean over H and W: ~170 us against
// a few). Reductions over leading or middle axes stay MLX's: it vectorises those over the columns.
#pragma once

#include <cstdint>
#include <vector>

#include <mlx/mlx.h>

namespace mlxd::rt {

enum class ReduceKind : uint8_t { sum, mean, max, min };

// Whether reduce_cpu takes x over `axes` (normalised, any order): kernels on (cpu_kernels_active), a
// non-empty float32 / bfloat16 / float16 x, and axes that are x's last ones, each once (a max over the
// last axis, a mean over a map's H and W).
bool reduce_cpu_applies(const mlx::core::array& x, const std::vector<int>& axes);

// The reduction, axes kept as 1 with keepdims; max and min propagate NaN as torch's amax / amin do.
mlx::core::array reduce_cpu(const mlx::core::array& x, ReduceKind kind, const std::vector<int>& axes,
                            bool keepdims);

}  // namespace mlxd::rt
