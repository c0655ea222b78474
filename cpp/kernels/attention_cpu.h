// Decode-sized scaled dot-product attention on the CPU as one MLX primitive:
// out = softmax(q k^T * scale + mask) v computed row by row in float32 math,
// rows split across the cores, AVX2 + FMA where the CPU has it. It replaces
// ~10 MLX ops per attention (scale, matmul through the BLAS, mask, softmax,
// matmul, the empty-row fix-up), whose dispatch dominates when a query has few
// rows. Longer queries (prefill, encoders) take the blocked path below.
#pragma once

#include <optional>

#include <mlx/mlx.h>

namespace mlxd::rt {

// Most query rows (L) the fused kernel takes: MLX_DELEGATE_SDPA_FUSED_MAX_L
// when set (0 turns this kernel alone off, for A/B runs; read each time a
// graph is built), else kFusedSdpaCpuMaxQueries. Each query row reads all of k
// and v, while the composed path's matmuls share them across rows. Measured
// per call on SmolLM2's shape (Hq 9, Hk 3, D 64, S 256, compiled, one process
// per path, 2 shared cores): L 1 and 2 faster fused (~100-165 us vs 160-570),
// L 4 even, L 16 slower (560-810 us vs 455-480).
constexpr int kFusedSdpaCpuMaxQueries = 2;
int fused_sdpa_cpu_max_queries();

// Whether fused_sdpa_cpu takes these operands: kernels on (cpu_kernels_active),
// q [B, Hq, L, D], k [B, Hk, S, D], v [B, Hk, S, Dv] with Hq % Hk == 0,
// 0 < L <= fused_sdpa_cpu_max_queries(), S > 0, q / k / v float32 / bfloat16 / float16,
// and the mask (when given) bool or floating and broadcastable to
// [B, Hq, L, S]. Any strides (cache slices, broadcasts): the kernel reads
// through them.
bool fused_sdpa_cpu_applies(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                      const std::optional<mlx::core::array>& mask);

// softmax(q k^T * scale + mask) v, [B, Hq, L, Dv] in q's dtype. Query head h
// reads key head h / (Hq / Hk). mask: bool keeps keys where true, floating is
// added to the scores. causal (only without a mask): query l sees keys 0..l
// (torch's top-left alignment). A query row that sees no key gives zeros
// (torch's result) instead of NaN.
mlx::core::array fused_sdpa_cpu(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                          float scale, const std::optional<mlx::core::array>& mask, bool causal);

// The decode rows' AVX-512 key and value loops (fp32 k / v, D = Dv a multiple of 16 up to 128):
// on by default; off runs the per-key vector loops (parity tests, A/B timings), from the next call on.
void fused_sdpa_cpu_set_row_loops(bool on);

// Long queries: blocks of 128 query rows of one head per task (64 past 2048
// keys), scores and P V each one single-threaded sgemm of torch's BLAS
// (mlxd_sgemm_serial in libmlxd_blas.so), mask and softmax on the block while
// it is in cache, the tasks split across the cores. Math in float32 (half
// q / k / v widened per head), except bfloat16 q / k / v on CPUs with bf16
// dot products (AVX-512-BF16): there both products are MKL's 16-bit gemm
// (fp32 scores and softmax, the weights rounded to bf16 for P V, as eager's
// flash attention does); MLX_DELEGATE_SDPA_BF16=0 keeps the fp32 path (read
// when a graph is built; counter "sdpa_blocked_bf16"). Whether it takes the operands: what
// fused_sdpa_cpu_applies asks except the row limit, the fast sgemm loaded, and
// MLX_DELEGATE_SDPA_BLOCKED not "0" (read each time a graph is built; for A/B
// runs: off, the composed matmul path runs instead).
bool blocked_sdpa_cpu_applies(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                              const std::optional<mlx::core::array>& mask);

// Same contract as fused_sdpa_cpu, any number of query rows.
mlx::core::array blocked_sdpa_cpu(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                  float scale, const std::optional<mlx::core::array>& mask, bool causal);

}  // namespace mlxd::rt
