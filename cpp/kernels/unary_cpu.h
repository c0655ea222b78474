// CPU kernels for the transcendental element-wise maps that dominate
// activations on the CPU (MLX's run one scalar libm call per element on one
// core): exp, sigmoid, SiLU, GELU (erf and tanh forms), erf, hard-swish and
// hard-sigmoid (MLX composes those of 4-5 single-core ops), as one MLX
// primitive vectorised with AVX2 + FMA (AVX-512F where the CPU has it) and
// split across the cores.
#pragma once

#include <cstdint>
#include <optional>

#include <mlx/mlx.h>

namespace mlxd::rt {

enum class UnaryKernel : uint8_t { exp, sigmoid, silu, gelu_erf, gelu_tanh, erf, hardswish, hardsigmoid };

// The float32 map of `kind` for the best ISA this CPU has: out[i] = f(in[i]),
// in == out allowed. For kernels that apply an activation in their own
// epilogue (the convolution's), on data already in cache.
using UnaryMapFn = void (*)(const float*, float*, int64_t);
UnaryMapFn unary_cpu_map(UnaryKernel kind);

// Whether unary_cpu takes x (and bias): kernels on (cpu_kernels_active) and a
// non-empty float32 / bfloat16 / float16 array. Any layout: non-contiguous
// inputs are copied to row-major first. A bias must be 1-D, as long as x's
// last axis, of a kernel dtype.
bool unary_cpu_applies(const mlx::core::array& x, const std::optional<mlx::core::array>& bias = std::nullopt);

// f(x + bias) element-wise in float32 math (bias, optional, along x's last
// axis: a linear's bias in the same pass as its activation), returned in x's
// dtype and shape; in place when x is row-major and has no other reader.
mlx::core::array unary_cpu(const mlx::core::array& x, UnaryKernel kind,
                           const std::optional<mlx::core::array>& bias = std::nullopt);

}  // namespace mlxd::rt
