// CPU kernels over the last axis of a row-major array: RMSNorm, LayerNorm,
// softmax and log-softmax, in float32 math for float32 / bfloat16 / float16
// inputs, as one MLX primitive vectorised with AVX2 + FMA (exp included) and
// splitting the rows across the cores. MLX's CPU versions run on one core with
// a scalar exp.
#pragma once

#include <cstdint>
#include <optional>

#include <mlx/mlx.h>

namespace mlxd::rt {

enum class RowKernel : uint8_t { rms_norm, layer_norm, softmax, log_softmax };

// Whether rows_cpu takes x (and the optional per-column weight / bias of an
// affine norm): kernels on (cpu_kernels_active), non-empty float32 / bfloat16 /
// float16 x with ndim >= 1, and weight / bias (when given) floating with as
// many elements as x's last axis.
bool rows_cpu_applies(const mlx::core::array& x, const std::optional<mlx::core::array>& weight = std::nullopt,
                      const std::optional<mlx::core::array>& bias = std::nullopt);

// The kernel over x's last axis. The result has x's shape and the dtype MLX's own op gives: mx::fast norms
// promote x with weight and bias, the others keep x's.
mlx::core::array rows_cpu(const mlx::core::array& x, RowKernel kind, float eps = 0.f,
                          const std::optional<mlx::core::array>& weight = std::nullopt,
                          const std::optional<mlx::core::array>& bias = std::nullopt);

// The index of each row's largest (max) or smallest element along x's last axis, as int64: the first
// such, a NaN counting as both the largest and the smallest (torch's and MLX's rule), the axis kept as 1
// with keepdims (arg_rows_cpu.cpp). A reshape of y (a squeeze, an added axis) reads y itself, in the
// same element order, so the view is no graph node of its own: an LLM's greedy argmax over its logits
// joins the step's kernel chain. For float32 / bfloat16 / float16 x with ndim >= 1, kernels on.
bool arg_rows_cpu_applies(const mlx::core::array& x);
mlx::core::array arg_rows_cpu(const mlx::core::array& x, bool max, bool keepdims);

}  // namespace mlxd::rt
