// A float32 linear layer on the CPU, y = x w^T (+ bias) (+ residual), as one MLX
// primitive: the bias and a fused residual are added in the task that computes
// each output block, while the block is in cache, instead of a separate
// broadcast add over the whole output (MLX's add is a single-core map). The sgemm is torch's MKL through the BLAS front (blas_shim.cpp), cut
// into column (or row) blocks on the kernel pool the way the front cuts MLX's
// own products (_blas.set_split_shape), each block one task.
#pragma once

#include <optional>

#include <mlx/mlx.h>

#include "kernels/unary_cpu.h"

namespace mlxd::rt {

// On unless MLX_DELEGATE_LINEAR_KERNEL=0 (measurements in linear_cpu.cpp); read while a graph is built (a
// compiled graph keeps the choice it was traced with), switchable for A/B
// runs in one process.
bool set_linear_cpu(bool on);  // returns the previous setting
bool linear_cpu_enabled();

// Whether linear_cpu takes x @ w^T (+ bias): linear_cpu_enabled(), CPU kernels active, the BLAS
// front's sgemm loaded and cutting products evenly over the pool (its default split policy), x float32 with more than kGemmLowpGemvRows rows
// (batch axes folded; fewer go to the GEMV), w an evaluated row-major
// float32 [N, K] matrix with K = x's last axis, and bias (when given) float32
// with N elements.
// residual (when given): float32 in the output's shape, any layout.
bool linear_cpu_applies(const mlx::core::array& x, const mlx::core::array& w,
                        const std::optional<mlx::core::array>& bias,
                        const std::optional<mlx::core::array>& residual = std::nullopt);

// act(x @ w^T + bias (+ residual)) in x's shape with the last axis N (counter "linear_f32"); the
// activation (a fused GELU / SiLU) is applied to each output block in cache, after the bias.
mlx::core::array linear_cpu(const mlx::core::array& x, const mlx::core::array& w,
                            const std::optional<mlx::core::array>& bias,
                            const std::optional<mlx::core::array>& residual = std::nullopt,
                            std::optional<UnaryKernel> act = std::nullopt);

}  // namespace mlxd::rt
