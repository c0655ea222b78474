// A single-threaded fp32 GEMM for x86-64 (AVX2 + FMA, and AVX-512F), inside the BLAS front
// (libmlxd_blas.so).
//
// Why: the front cuts large products into blocks, one per pool thread, each a single-threaded sgemm.
// MKL's single-threaded sgemm is slow on AMD processors: on an AVX2-only EPYC (Zen 3) it ran ViT-B/16's
// product blocks at 41-55 GFLOP/s per core, where MKL's own team reached 60 and the AVX2 tile here
// 65-77; on an AVX-512 EPYC (Zen 5) MKL stays on 256-bit code (~110 GFLOP/s a core), where the
// AVX-512 tile here runs at full width (docs/cpu-backend.md). On Intel processors with AVX-512, MKL's
// own AVX-512 kernels keep the blocks by default.
//
// The classic blocked layout: the operands are packed per block (op(b) in panels as wide as the
// tile, op(a) in panels as tall as it, k cut into equal blocks) and a register tile of accumulators
// takes one broadcast of a per row and two loads of b per k step: 6 x 16 with AVX2, 8 x 32 with
// AVX-512.
#pragma once

#include <cstdint>

namespace mlxd::blas {

// Instruction sets of own_sgemm's tile (0: none, the processor lacks AVX2 + FMA).
constexpr int kOwnAvx2 = 1, kOwnAvx512 = 2;

// The widest tile this processor runs (kOwnAvx512, kOwnAvx2 or 0).
int own_sgemm_best();

// Row-major c[m, n] = alpha op(a) op(b) + beta c on the calling thread with the `isa` tile, op
// transposing where trans_* is set (a stored [k, m] / b stored [n, k]); beta 0 never reads c.
// Requires 0 < isa <= own_sgemm_best().
void own_sgemm(int isa, bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc);

// op(a) laid out once for many products (a layer's weights, stored row-major [m, k]) in the panels the
// `isa` tile reads, so the products skip packing it: as the tile's rows, or, where own_sgemm would run
// products of m_hint rows and n_hint columns transposed (few columns), as the columns of the
// transposed product (`across`: for products written across, own_sgemm_packed_a_ct, wherever that form
// wastes about as little). own_pack_a_floats(m, k) floats at dst (any tile, either form); a header
// records the tile and the form.
int64_t own_pack_a_floats(int m, int k);
void own_pack_a(int isa, int m, int k, int m_hint, int n_hint, bool across, const float* a, int lda, float* dst);
// The tile a pack was made for (0: not a pack), and the multiple its row ranges must start at.
int own_pack_a_isa(const float* pack);
int own_pack_a_align(const float* pack);
// Rows [r0, r0 + m) of a pack (r0 aligned as own_pack_a_align says) into dst (own_pack_a_floats(m, k)
// floats) as a pack of their own with column p of a multiplied by kscale[p]: a squeeze-excite gate folded
// into a layer's packed weight per call. False, writing nothing, where `pack` is not one or the rows do
// not fit.
bool own_pack_a_scaled(const float* pack, int r0, int m, const float* kscale, float* dst);
// c[m, n] = alpha a[r0 : r0 + m, :] op(b) + beta c with a [., k] packed by own_pack_a (its tile), on
// the calling thread. False, doing nothing, when `pack` is not one, holds another k, or the rows are
// outside it or not aligned.
bool own_sgemm_packed_a(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b,
                        int ldb, float beta, float* c, int ldc);
// The same product written across, ct[n, m] (row stride ldct) = (a[r0 : r0 + m, :] op(b))^T + beta ct:
// a block whose next step reads the product pixel by pixel (channels contiguous).
bool own_sgemm_packed_a_ct(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha,
                           const float* b, int ldb, float beta, float* ct, int ldct);

// op(b) written panel by panel by the caller instead of packed from memory (quantized weights
// dequantized straight into the tile's panels, no float32 copy of them): fn(ctx, j, nr, pc, kc, dst,
// width) writes dst[p * width + q] = op(b)[pc + p, j + q] for p < kc, q < nr, and zeros for nr <= q <
// width. k blocks start at multiples of 8.
using BPanelFn = void (*)(void* ctx, int j, int nr, int pc, int kc, float* dst, int width);
struct BPanelSource {
  BPanelFn fn = nullptr;
  void* ctx = nullptr;
};
// Row-major c[m, n] = alpha a op(b) + beta c, a stored [m, k], op(b) [k, n] from `source`, on the
// calling thread with the `isa` tile (0 < isa <= own_sgemm_best()).
void own_sgemm_b_source(int isa, int m, int n, int k, float alpha, const float* a, int lda, BPanelSource source,
                        float beta, float* c, int ldc);

}  // namespace mlxd::blas
