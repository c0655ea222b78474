// Rows of an affine-quantized table (MLX's layout: packed uint32 words, a scale and a bias per group)
// gathered by index and dequantized in float32, as one CPU primitive.
//
// Why: MLX builds the same lookup from a gather per operand and an unpack into shifts, masks,
// concatenations and a multiply-add: 23 graph arrays a SmolLM2 decode step (Q8_0 embedding), each a
// walk step and two stream tasks before the step's first product. As a kernel it is one array, and a
// kernel chain takes it together with the first layer's product (kernel_chain.h).
#pragma once

#include <mlx/mlx.h>

namespace mlxd::rt {

// Whether qembed_cpu takes these operands: kernels on (cpu_kernels_active); w uint32 [N, W] and scales /
// biases float32 / bfloat16 / float16 [N, K / group_size] (K = W * 32 / bits), all three row-contiguous
// constants; bits 2, 4 or 8; integer indices; `out` float32 / bfloat16 / float16.
bool qembed_cpu_applies(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases,
                        const mlx::core::array& indices, int group_size, int bits, mlx::core::Dtype out);

// Rows w[indices] dequantized (scale * q + bias, in float32, then `out`): indices.shape + [K]. A negative
// index counts from the end, as in MLX's take; one outside the table reads its nearest row (the runtime
// checks bound inputs beforehand: ExecContext::guard_index).
mlx::core::array qembed_cpu(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases,
                            const mlx::core::array& indices, int group_size, int bits, mlx::core::Dtype out);

}  // namespace mlxd::rt
