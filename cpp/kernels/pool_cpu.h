// Max pooling over the last one or two axes on the CPU as one MLX primitive.
// MLX has no pooling op: the composed form pads the input with -inf (a full
// copy), takes a strided view of every window and reduces it, several graph
// nodes and passes per call. This kernel reads each window in place, one
// (batch, channel) plane per task. Math in float32 (max is exact in it).
#pragma once

#include <vector>

#include <mlx/mlx.h>

namespace mlxd::rt {

// Whether max_pool_cpu takes x: kernels on (cpu_kernels_active), a non-empty
// float32 / bfloat16 / float16 x, and one or two pooled (trailing) axes.
bool max_pool_cpu_applies(const mlx::core::array& x, size_t pooled_axes);

// torch's max_pool{1,2}d values: windows `kernel` with `stride`, low-side
// `padding` and `dilation` over the trailing axes, `out_sizes` outputs per axis
// (ceil mode already applied by the caller); padding never wins.
mlx::core::array max_pool_cpu(const mlx::core::array& x, const std::vector<int>& kernel,
                              const std::vector<int>& stride, const std::vector<int>& padding,
                              const std::vector<int>& dilation, const std::vector<int>& out_sizes);

}  // namespace mlxd::rt
