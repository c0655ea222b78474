// A CPU matmul for bfloat16 / float16 operands (fp32 accumulation, result in
// the operand dtype), as an MLX primitive. MLX's own CPU matmul for these
// dtypes is a scalar loop (~3 GFLOP/s) with no BLAS behind it. Here:
// - up to kGemmLowpGemvRows rows (decode): our GEMV, N split across the cores;
//   AVX-512-BF16 dot products for bf16, AVX2 + FMA (+ F16C) converting to fp32
//   otherwise, and a portable loop;
// - more rows (prefill): MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32
//   from the torch wheel, reached through libmlxd_blas.so (cpp/blas_shim.cpp);
//   without it, the GEMV over blocks of rows.
// Operands may be row-major or transposed views (a linear's [N, K] weight is
// read in place); other layouts are packed first.
// float32 (MLX's CPU matmul is MKL's sgemm, far from memory bandwidth at a few
// rows): the same GEMV (AVX-512F / AVX2 + FMA / portable) for up to
// kGemmLowpGemvRows rows when b is a 2-D weight stored transposed ([N, K]
// row-major, read in place); everything else stays on MLX's matmul. Counter
// "gemv_f32".
#pragma once

#include <cstdint>

#include <mlx/mlx.h>

namespace mlxd::rt {

constexpr int64_t kGemmLowpGemvRows = 8;

// Whether gemm_lowp_cpu takes a @ b: CPU kernels active (default device CPU,
// MLX_DELEGATE_CPU_KERNELS not 0), both bfloat16 or both float16, non-empty,
// ranks >= 2 with b 2-D or the same batch shape as a; or both float32 with
// at most kGemmLowpGemvRows rows of a (batch axes folded) and b a 2-D
// transposed weight (see above).
// MLX_DELEGATE_CPU_KERNELS=portable forces the portable GEMV, =avx2 caps it at AVX2.
bool gemm_lowp_cpu_applies(const mlx::core::array& a, const mlx::core::array& b);

// torch.matmul(a, b) for the operands gemm_lowp_cpu_applies accepts.
mlx::core::array gemm_lowp_cpu(const mlx::core::array& a, const mlx::core::array& b);

// x @ w^T for a linear's [N, K] weight: what gemm_lowp_cpu(x, transpose(w))
// computes, with the weight read in place and no transpose node per call.
bool gemm_lowp_cpu_linear_applies(const mlx::core::array& x, const mlx::core::array& w);
mlx::core::array gemm_lowp_cpu_linear(const mlx::core::array& x, const mlx::core::array& w);

}  // namespace mlxd::rt
