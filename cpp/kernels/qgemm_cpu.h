// A CPU kernel for prefill-sized weight-only quantized products:
// y[M, N] = x[M, K] . dequantize(w)^T in MLX's affine layout, as an MLX
// primitive. Chunks of output rows of w are dequantized to float32 into a
// buffer that stays in the core's cache and multiplied by all M rows of x with
// one single-threaded sgemm of torch's BLAS (mlxd_sgemm_serial in the BLAS
// front); the chunks are split across the cores. With many rows of x the
// sgemm's multiply-adds cost far less than the integer GEMV's (qgemv_cpu.h),
// and the dequantization is paid once per weight instead of once per 8 rows.
#pragma once

#include <cstdint>

#include <mlx/mlx.h>

namespace mlxd::rt {

// From this many rows of x on, qgemm_cpu takes products qgemv_cpu would. With w dequantized into
// the tile's panels (Ice Lake Xeon, paired prefills node by node): the 1.2B Llama's int4 linears (K
// 2048 / 8192) level with the integer GEMV at 12 rows (0.89x its time at 8, 1.52x faster at 16);
// SmolLM2's (K 576-1536) 1.2-1.25x faster at 8, 1.4x at 12.
constexpr int64_t kQgemmMinRows = 12;

// Whether qgemm_cpu takes this product: cpu_kernels_active(), MLX_DELEGATE_QGEMM is not "0" (read
// each time a graph is built), at least kQgemmMinRows rows of x, bits 4 or 8, a group size that is a
// multiple of 32 dividing K, and the BLAS front serves a serial sgemm.
bool qgemm_cpu_applies(const mlx::core::array& x, int group_size, int bits);

// x [..., K] (float32 / bfloat16 / float16, any layout), w [N, K * bits / 32] uint32, scales and
// biases [N, K / group_size] (float dtypes); returns [..., N] float32.
mlx::core::array qgemm_cpu(const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& scales,
                           const mlx::core::array& biases, int group_size, int bits);

}  // namespace mlxd::rt
