// torch's quantize_per_tensor -> dequantize_per_tensor pair (a PT2E model's activations) on the CPU as
// one pass: MLX composes it of eight single-core ops, its round a libm call per element.
#pragma once

#include <mlx/mlx.h>

namespace mlxd::rt {

struct FakeQuantParams {
  float inv_scale, scale, zero_point, quant_min, quant_max;
  float lo, hi;  // x clamped to [lo, hi] first (-inf / inf: no clamp)
};

// Whether fake_quant_cpu takes x: kernels on and a non-empty float32 array (any layout).
bool fake_quant_cpu_applies(const mlx::core::array& x);

// (clamp(rint(clamp(x, lo, hi) * inv_scale) + zero_point, quant_min, quant_max) - zero_point) * scale, ties
// to even, in
// x's shape; in place when x is row-major and has no other reader.
mlx::core::array fake_quant_cpu(const mlx::core::array& x, const FakeQuantParams& p);

// The same on MLX's own ops (kernels off, GPUs): equal to the bit.
mlx::core::array fake_quant_mlx(const mlx::core::array& x, const FakeQuantParams& p);

}  // namespace mlxd::rt
