// See sgemm_avx2.h.
#include "sgemm_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MLXD_SGEMM_X86 1
#define MLXD_SGEMM_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace mlxd::blas {

#ifdef MLXD_SGEMM_X86
namespace {

constexpr int kMr = 6, kNr = 16;
// k block: one 16-column panel of op(b) (32 KiB at 512) stays in L1 while the tiles of a row block
// pass over it. Blocks of 384 / 512 measured 5-15 % faster than 256 on the Zen 3 (products of
// ViT-B/16 and BERT, one core each).
constexpr int kMaxKc = 384;
constexpr int kMaxMc = 144;  // rows of op(a) packed at a time (216 KiB at kc 384: within L2)
constexpr int kNc = 1024;  // columns of op(b) packed at a time (2 MiB at kc 512: in L3)

// dst[p * ldd + r] = src[r * lds + p] for r < rows (r < width are written: zeros past rows), p < kc:
// rows of a stored operand become the lanes of a panel (op(a) stored [m, k]; op(b) stored [n, k]).
// Eight k at a time by an 8x8 transpose in registers; the vector stores write eight lanes, so a
// panel narrower than eight (width 6) spills two floats past each step, which the next step (or the
// next panel, packed later) overwrites; the buffers leave room for the last one.
MLXD_SGEMM_AVX2 void pack_gather(const float* src, int64_t lds, int rows, int kc, float* dst, int ldd, int width) {
  int p = 0;
  if (rows > 0) {
    for (; p + 8 <= kc; p += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = i < rows ? _mm256_loadu_ps(src + i * lds + p) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 out[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                             _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                             _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                             _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (int q = 0; q < 8; ++q) _mm256_storeu_ps(dst + int64_t{p + q} * ldd, out[q]);
    }
  }
  for (; p < kc; ++p)
    for (int i = 0; i < width; ++i) dst[int64_t{p} * ldd + i] = i < rows ? src[i * lds + p] : 0.f;
}

// dst[p * ldd + r] = src[p * lds + r] for r < cols (zeros up to width), p < kc: an operand stored
// with the panel's axis contiguous (op(a) stored [k, m]; op(b) stored [k, n]).
MLXD_SGEMM_AVX2 void pack_copy(const float* src, int64_t lds, int cols, int kc, float* dst, int ldd, int width) {
  for (int p = 0; p < kc; ++p, src += lds, dst += ldd) {
    if (cols == 16 && width == 16) {
      _mm256_storeu_ps(dst, _mm256_loadu_ps(src));
      _mm256_storeu_ps(dst + 8, _mm256_loadu_ps(src + 8));
    } else {
      for (int i = 0; i < width; ++i) dst[i] = i < cols ? src[i] : 0.f;
    }
  }
}

// Packs columns [j, j + nr) of op(b) over k in [pc, pc + kc) as one 16-wide panel (zeros past nr).
MLXD_SGEMM_AVX2 void pack_b_panel(bool trans_b, const float* b, int64_t ldb, int j, int pc, int kc, int nr,
                                  float* dst) {
  if (trans_b) {
    const float* src = b + j * ldb + pc;
    pack_gather(src, ldb, std::min(nr, 8), kc, dst, kNr, 8);
    pack_gather(nr > 8 ? src + 8 * ldb : src, ldb, std::max(0, nr - 8), kc, dst + 8, kNr, 8);
  } else {
    pack_copy(b + pc * ldb + j, ldb, nr, kc, dst, kNr, kNr);
  }
}

// Prefetches slice `part` of `parts` of the memory pack_b_panel will read for columns [j, j + nr),
// into L2: spread over the tiles of the panel before it, so the loads trickle in.
inline void prefetch_panel(bool trans_b, const float* b, int64_t ldb, int j, int pc, int kc, int nr, int part,
                           int parts) {
  if (trans_b) {  // nr rows of kc floats: kc / 16 lines each
    const int per_row = (kc + 15) / 16, lines = nr * per_row;
    for (int l = lines * part / parts; l < lines * (part + 1) / parts; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(b + (j + l / per_row) * ldb + pc + (l % per_row) * 16), _MM_HINT_T1);
  } else {  // kc rows of nr floats: a line (or two) each
    for (int p = kc * part / parts; p < kc * (part + 1) / parts; ++p) {
      const float* row = b + (pc + p) * ldb + j;
      _mm_prefetch(reinterpret_cast<const char*>(row), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(row + nr - 1), _MM_HINT_T1);
    }
  }
}

// c = alpha v + beta c (beta 0: c is not read).
MLXD_SGEMM_AVX2 inline void put(float* c, __m256 v, __m256 alpha, float beta) {
  v = _mm256_mul_ps(v, alpha);
  if (beta != 0.f) v = _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c), v);
  _mm256_storeu_ps(c, v);
}

// The 6x16 tile c = alpha a-panel . b-panel + beta c over kc steps; twelve accumulators, so each
// step is two loads of b, six broadcasts of a and twelve independent FMAs.
MLXD_SGEMM_AVX2 void tile(int kc, const float* a, const float* b, float* c, int64_t ldc, float alpha_s,
                          float beta) {
  __m256 acc[kMr][2];  // fully unrolled below, so the compiler keeps all twelve in registers
#pragma GCC unroll 6
  for (int r = 0; r < kMr; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int p = 0; p < kc; ++p, a += kMr, b += kNr) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kMr; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  const __m256 alpha = _mm256_set1_ps(alpha_s);
#pragma GCC unroll 6
  for (int r = 0; r < kMr; ++r) {
    put(c + r * ldc, acc[r][0], alpha, beta);
    put(c + r * ldc + 8, acc[r][1], alpha, beta);
  }
}

// A tile at the right or bottom edge: computed whole into scratch (the panels are zero-padded),
// then its mr x nr corner combined into c.
MLXD_SGEMM_AVX2 void edge_tile(int kc, const float* a, const float* b, float* c, int64_t ldc, int mr, int nr,
                               float alpha, float beta) {
  alignas(32) float t[kMr * kNr];
  tile(kc, a, b, t, kNr, alpha, 0.f);
  for (int r = 0; r < mr; ++r)
    for (int q = 0; q < nr; ++q) {
      float& out = c[r * ldc + q];
      out = beta == 0.f ? t[r * kNr + q] : std::fma(beta, out, t[r * kNr + q]);  // as put's FMA
    }
}

// 64-byte aligned packing buffers, one pair per thread (pool threads call concurrently), kept.
struct Scratch {
  std::vector<float> a_mem, b_mem;
  float *a = nullptr, *b = nullptr;
  Scratch() {
    // Room for the 8-lane stores past a 6-wide panel's end, and for alignment.
    a_mem.resize(size_t{kMaxMc} * kMaxKc + 32);
    b_mem.resize(size_t{kNc} * kMaxKc + 32);
    a = align(a_mem.data());
    b = align(b_mem.data());
  }
  static float* align(float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63}); }
};

}  // namespace

bool own_sgemm_available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

void own_sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == 0.f) {  // c = beta c, without reading c when beta is 0
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[int64_t{i} * ldc + j] = beta == 0.f ? 0.f : beta * c[int64_t{i} * ldc + j];
    return;
  }
  thread_local Scratch s;
  // Equal k blocks of at most kMaxKc (768 = 2 x 384, not 512 + 256), multiples of 8 except the last.
  const int k_blocks = (k + kMaxKc - 1) / kMaxKc;
  const int kc_step = std::min(kMaxKc, ((k + k_blocks - 1) / k_blocks + 7) / 8 * 8);
  // Equal row blocks of at most kMaxMc, multiples of 6: 128 rows as one block, not 72 + 56.
  const int m_blocks = (m + kMaxMc - 1) / kMaxMc;
  const int mc_step = std::min(kMaxMc, ((m + m_blocks - 1) / m_blocks + kMr - 1) / kMr * kMr);
  for (int jc = 0; jc < n; jc += kNc) {
    const int nc = std::min(kNc, n - jc);
    for (int pc = 0; pc < k; pc += kc_step) {
      const int kc = std::min(kc_step, k - pc);
      const float beta_here = pc == 0 ? beta : 1.f;  // later k blocks add to the first's result
      for (int ic = 0; ic < m; ic += mc_step) {
        const int mc = std::min(mc_step, m - ic);
        for (int i = 0; i < mc; i += kMr) {
          const int mr = std::min(kMr, mc - i);
          float* dst = s.a + int64_t{i} * kc;
          if (trans_a) pack_copy(a + int64_t{pc} * lda + ic + i, lda, mr, kc, dst, kMr, kMr);
          else pack_gather(a + int64_t{ic + i} * lda + pc, lda, mr, kc, dst, kMr, kMr);
        }
        for (int j = 0; j < nc; j += kNr) {
          const int nr = std::min(kNr, nc - j);
          // op(b)'s panels are packed during the first row block, each just before its tiles, so
          // reading them from memory overlaps the tiles' arithmetic (and its prefetched source) where
          // packing the whole block first left both threads waiting on memory at once.
          if (ic == 0) pack_b_panel(trans_b, b, ldb, jc + j, pc, kc, nr, s.b + int64_t{j} * kc);
          const bool fetch_next = ic == 0 && j + kNr < nc;
          const int tiles = (mc + kMr - 1) / kMr;
          for (int i = 0, t = 0; i < mc; i += kMr, ++t) {
            const int mr = std::min(kMr, mc - i);
            if (fetch_next) prefetch_panel(trans_b, b, ldb, jc + j + kNr, pc, kc, std::min(kNr, nc - j - kNr), t, tiles);
            float* out = c + int64_t{ic + i} * ldc + jc + j;
            const float *ap = s.a + int64_t{i} * kc, *bp = s.b + int64_t{j} * kc;
            if (mr == kMr && nr == kNr) tile(kc, ap, bp, out, ldc, alpha, beta_here);
            else edge_tile(kc, ap, bp, out, ldc, mr, nr, alpha, beta_here);
          }
        }
      }
    }
  }
}

#else  // not x86-64: the front keeps the loaded BLAS

bool own_sgemm_available() { return false; }
void own_sgemm(bool, bool, int, int, int, float, const float*, int, const float*, int, float, float*, int) {}

#endif

}  // namespace mlxd::blas
