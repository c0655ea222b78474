// A single-threaded fp32 GEMM for x86-64 with AVX2 + FMA, inside the BLAS front (libmlxd_blas.so).
//
// Why: the front cuts large products into blocks, one per pool thread, each a single-threaded sgemm.
// On AVX2-only processors (an AMD EPYC Zen 3 measured) MKL's single-threaded sgemm ran at 41-55
// GFLOP/s per core on ViT-B/16's products, where MKL's own team reached 60, so cutting lost to one
// team call; this kernel runs the same blocks at 65-77 (docs/cpu-backend.md). On AVX-512 processors
// MKL keeps them (its AVX-512 kernels are not matched by AVX2 code).
//
// The classic blocked layout: the operands are packed per block (op(b) in 16-column panels, op(a)
// in 6-row panels, k cut into blocks of at most 512) and a 6x16 register tile of 12 AVX2
// accumulators takes one broadcast of a and two loads of b per six pairs of FMAs.
#pragma once

namespace mlxd::blas {

// Whether own_sgemm can run on this processor (x86-64 with AVX2 and FMA).
bool own_sgemm_available();

// Row-major c[m, n] = alpha op(a) op(b) + beta c on the calling thread, op transposing where
// trans_* is set (a stored [k, m] / b stored [n, k]); beta 0 never reads c. Requires
// own_sgemm_available().
void own_sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc);

}  // namespace mlxd::blas
