// See sgemm_x86.h.
#include "sgemm_x86.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MLXD_SGEMM_X86 1
#define MLXD_SGEMM_AVX2 __attribute__((target("avx2,fma")))
#define MLXD_SGEMM_AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif

namespace mlxd::blas {

#ifdef MLXD_SGEMM_X86
namespace {

// Shared by both register tiles: they pack op(a) / op(b) the same way and differ in panel widths.
constexpr int kMaxMc = 144;  // rows of op(a) packed at a time (216 KiB at kc 384: within L2)
constexpr int kNc = 1024;  // columns of op(b) packed at a time (2 MiB at kc 512: in L3)
constexpr int kMaxKcAny = 384;  // the scratch's k extent: the larger of the tiles' k blocks

// out[q] lane i = r[i] lane q: an 8 x 8 transpose in registers.
MLXD_SGEMM_AVX2 inline void transpose8(const __m256 r[8], __m256 out[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  out[0] = _mm256_permute2f128_ps(u0, u4, 0x20), out[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  out[2] = _mm256_permute2f128_ps(u2, u6, 0x20), out[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  out[4] = _mm256_permute2f128_ps(u0, u4, 0x31), out[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  out[6] = _mm256_permute2f128_ps(u2, u6, 0x31), out[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// dst[p * ldd + r] = src[r * lds + p] for r < rows (r < width are written: zeros past rows), p < kc:
// rows of a stored operand become the lanes of a panel (op(a) stored [m, k]; op(b) stored [n, k]).
// Eight k at a time by an 8x8 transpose in registers; the vector stores write eight lanes, so a
// panel narrower than eight (width 6) spills two floats past each step, which the next step (or the
// next panel, packed later) overwrites; the buffers leave room for the last one.
MLXD_SGEMM_AVX2 void pack_gather(const float* src, int64_t lds, int rows, int kc, float* dst, int ldd, int width) {
  int p = 0;
  if (rows > 0) {
    for (; p + 8 <= kc; p += 8) {
      __m256 r[8], out[8];
      for (int i = 0; i < 8; ++i) r[i] = i < rows ? _mm256_loadu_ps(src + i * lds + p) : _mm256_setzero_ps();
      transpose8(r, out);
      for (int q = 0; q < 8; ++q) _mm256_storeu_ps(dst + int64_t{p + q} * ldd, out[q]);
    }
  }
  for (; p < kc; ++p)
    for (int i = 0; i < width; ++i) dst[int64_t{p} * ldd + i] = i < rows ? src[i * lds + p] : 0.f;
}

// dst[p * ldd + r] = src[p * lds + r] for r < cols (zeros up to width), p < kc: an operand stored
// with the panel's axis contiguous (op(a) stored [k, m]; op(b) stored [k, n]).
MLXD_SGEMM_AVX2 void pack_copy(const float* src, int64_t lds, int cols, int kc, float* dst, int ldd, int width) {
  if (cols == width && width < 8) {  // a seven- or six-row panel: eight-lane stores spill past, as above
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(width), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int p = 0; p < kc; ++p, src += lds, dst += ldd) _mm256_storeu_ps(dst, _mm256_maskload_ps(src, lanes));
    return;
  }
  for (int p = 0; p < kc; ++p, src += lds, dst += ldd) {
    if (cols == width && width % 8 == 0) {
      for (int i = 0; i < width; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(src + i));
    } else {
      for (int i = 0; i < width; ++i) dst[i] = i < cols ? src[i] : 0.f;
    }
  }
}

// Packs columns [j, j + nr) of op(b) over k in [pc, pc + kc) as one nr_panel-wide panel (zeros past nr).
MLXD_SGEMM_AVX2 void pack_b_panel(bool trans_b, const float* b, int64_t ldb, int j, int pc, int kc, int nr,
                                  int nr_panel, float* dst) {
  if (trans_b) {  // eight rows of op(b)'s storage at a time; no pointer is formed past the last row
    const float* src = b + j * ldb + pc;
    for (int q = 0; q < nr_panel; q += 8)
      pack_gather(q < nr ? src + q * ldb : src, ldb, std::clamp(nr - q, 0, 8), kc, dst + q, nr_panel, 8);
  } else {
    pack_copy(b + pc * ldb + j, ldb, nr, kc, dst, nr_panel, nr_panel);
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

// Whether the tiles of an m-row product read whole panels of an untransposed b where it lies (row
// stride ldb) instead of a packed copy. The copy is a pass over b per call, worth it only where many
// row tiles reuse each panel: one thread, 64 x 3136 x 64 ran 185 -> 208 GFLOP/s in place, 1024 x 3136
// x 64 231 -> 224, so products of at most 256 rows. Not where rows lie a multiple of 1 KiB apart (a
// panel's rows would share a few L1 sets). MLX_DELEGATE_SGEMM_B_IN_PLACE: the row limit (0: never),
// read at start-up.
inline bool b_in_place(int64_t ldb, int m) {
  static const int max_rows = [] {
    const char* e = std::getenv("MLX_DELEGATE_SGEMM_B_IN_PLACE");
    return e ? std::atoi(e) : 256;
  }();
  return m <= max_rows && (ldb * 4) % 1024 != 0;
}

// The register tile's body, one for both instruction sets: V is a GCC vector of kNr / 2 floats, so the
// same code becomes AVX2 (ymm) or AVX-512 (zmm) instructions in the tile it is inlined into. Mr rows of
// H = Nr / lanes accumulators each (two; one for a half-width edge panel): per k step H loads of b, Mr
// broadcasts of a and H Mr independent FMAs (the multiply-adds contract: the library builds as GNU C++).
// Then c = alpha acc + beta c (beta 0: c is not read).
template <typename V, int Mr, int Nr>
__attribute__((always_inline)) inline void tile_body(int kc, const float* a, const float* b, int64_t bs, float* c,
                                                     int64_t ldc, float alpha, float beta) {
  constexpr int kLanes = sizeof(V) / sizeof(float), H = Nr / kLanes;
  static_assert(H == 1 || H == 2);
  V acc[Mr][H] = {};  // fully unrolled below, so the compiler keeps them all in registers
  for (int p = 0; p < kc; ++p, a += Mr, b += bs) {
    V bv[H];
    for (int h = 0; h < H; ++h) std::memcpy(&bv[h], b + h * kLanes, sizeof(V));
#pragma GCC unroll 8
    for (int r = 0; r < Mr; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] += bv[h] * a[r];  // a[r] broadcast (an FMA's memory operand on AVX-512)
  }
#pragma GCC unroll 8
  for (int r = 0; r < Mr; ++r)
    for (int h = 0; h < H; ++h) {
      float* out = c + r * ldc + h * kLanes;
      V v = acc[r][h] * alpha;
      if (beta != 0.f) {
        V old;
        std::memcpy(&old, out, sizeof(V));
        v = beta * old + v;
      }
      std::memcpy(out, &v, sizeof(V));
    }
}

typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats16 __attribute__((vector_size(64)));

// The AVX2 tile, 6 x 16: twelve 8-lane accumulators.
struct Avx2Tile {
  static constexpr int kMr = 6, kNr = 16;
  // k block: one 16-column panel of op(b) (24 KiB at 384) stays in L1 while the tiles of a row block
  // pass over it. Blocks of 384 / 512 measured 5-15 % faster than 256 on the Zen 3 (products of
  // ViT-B/16 and BERT, one core each).
  static constexpr int kMaxKc = 384;
  MLXD_SGEMM_AVX2 static void tile(int kc, const float* a, const float* b, float* c, int64_t ldc, float alpha,
                                   float beta, int64_t bs = kNr) {
    tile_body<Floats8, kMr, kNr>(kc, a, b, bs, c, ldc, alpha, beta);
  }
  // The left half of a panel only (an edge panel of at most kNr / 2 columns): half the multiply-adds.
  MLXD_SGEMM_AVX2 static void half(int kc, const float* a, const float* b, float* c, int64_t ldc, float alpha,
                                   float beta, int64_t bs = kNr) {
    tile_body<Floats8, kMr, kNr / 2>(kc, a, b, bs, c, ldc, alpha, beta);
  }
};

// The AVX-512 tile, 8 x 32: sixteen 16-lane accumulators, twice the AVX2 tile's multiply-adds per
// instruction where the processor runs 512-bit FMAs at full width.
struct Avx512Tile {
  static constexpr int kMr = 8, kNr = 32;
  static constexpr int kMaxKc = 256;  // a 32-column panel: 32 KiB of L1 at 256
  MLXD_SGEMM_AVX512 static void tile(int kc, const float* a, const float* b, float* c, int64_t ldc, float alpha,
                                     float beta, int64_t bs = kNr) {
    tile_body<Floats16, kMr, kNr>(kc, a, b, bs, c, ldc, alpha, beta);
  }
  // The left half of a panel only (an edge panel of at most kNr / 2 columns): half the multiply-adds.
  MLXD_SGEMM_AVX512 static void half(int kc, const float* a, const float* b, float* c, int64_t ldc, float alpha,
                                   float beta, int64_t bs = kNr) {
    tile_body<Floats16, kMr, kNr / 2>(kc, a, b, bs, c, ldc, alpha, beta);
  }
};

// The AVX-512 tile's seven-row form, for products whose rows fill sevens better than eights: a 7x7
// map's 49 rows (computed transposed) are seven whole tiles, not six and one of a single row.
struct Avx512Tile7 {
  static constexpr int kMr = 7, kNr = 32;
  static constexpr int kMaxKc = Avx512Tile::kMaxKc;  // the same k blocks: packed weights serve both
  MLXD_SGEMM_AVX512 static void tile(int kc, const float* a, const float* b, float* c, int64_t ldc, float alpha,
                                     float beta, int64_t bs = kNr) {
    tile_body<Floats16, kMr, kNr>(kc, a, b, bs, c, ldc, alpha, beta);
  }
  // The left half of a panel only (an edge panel of at most kNr / 2 columns): half the multiply-adds.
  MLXD_SGEMM_AVX512 static void half(int kc, const float* a, const float* b, float* c, int64_t ldc, float alpha,
                                   float beta, int64_t bs = kNr) {
    tile_body<Floats16, kMr, kNr / 2>(kc, a, b, bs, c, ldc, alpha, beta);
  }
};

// A tile at the right or bottom edge: computed whole into scratch (the panels are zero-padded),
// then its mr x nr corner combined into c.
// A panel of at most half its width (MobileNets' 80, 112 and 240 channels leave 16) runs the half tile:
// 112 columns cost 3.5 tiles' multiply-adds, not 4.
template <typename T>
MLXD_SGEMM_AVX2 void edge_tile(int kc, const float* a, const float* b, float* c, int64_t ldc, int mr, int nr, float alpha,
               float beta, int64_t bs = T::kNr) {
  constexpr int kHalf = T::kNr / 2;
  const bool half = nr <= kHalf;
  if (half && mr == T::kMr && nr == kHalf) return T::half(kc, a, b, c, ldc, alpha, beta, bs);
  alignas(64) float t[T::kMr * T::kNr];
  const int w = half ? kHalf : T::kNr;
  if (half) T::half(kc, a, b, t, w, alpha, 0.f, bs);
  else T::tile(kc, a, b, t, w, alpha, 0.f, bs);
  for (int r = 0; r < mr; ++r)
    for (int q = 0; q < nr; ++q) {
      float& out = c[r * ldc + q];
      out = beta == 0.f ? t[r * w + q] : __builtin_fmaf(beta, out, t[r * w + q]);  // as the tile's FMA
    }
}

// 64-byte aligned packing buffers, one pair per thread (pool threads call concurrently), kept.
struct Scratch {
  std::vector<float> a_mem, b_mem;
  float *a = nullptr, *b = nullptr;
  Scratch() {
    // Room for the 8-lane stores past a 6-wide panel's end, and for alignment.
    a_mem.resize(size_t{kMaxMc} * kMaxKcAny + 32);
    b_mem.resize(size_t{kNc} * kMaxKcAny + 32);
    a = align(a_mem.data());
    b = align(b_mem.data());
  }
  static float* align(float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63}); }
};

Scratch& scratch() {
  thread_local Scratch s;  // one per thread for every tile
  return s;
}

// Equal k blocks of at most T::kMaxKc (768 = 2 x 384, not 512 + 256), multiples of 8 except the last.
template <typename T>
int kc_step_for(int k) {
  const int k_blocks = (k + T::kMaxKc - 1) / T::kMaxKc;
  return std::min(T::kMaxKc, ((k + k_blocks - 1) / k_blocks + 7) / 8 * 8);
}

// An operand packed ahead of the call (own_pack_a): k block pc's panels start at base + pc * stride
// (stride: the packed extent, rows or columns, rounded up to whole panels), and within it the panel
// of row (or column) r0 + r at r * kc. base null: packed per call into the scratch.
struct Prepacked {
  const float* base = nullptr;
  int64_t stride = 0;
  int r0 = 0;
  const float* at(int pc, int r, int kc) const { return base + pc * stride + int64_t{r0 + r} * kc; }
};

template <typename T>
void blocked_sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                   const float* b, int ldb, float beta, float* c, int ldc, Prepacked pa = {}, Prepacked pb = {},
                   BPanelSource source = {}) {
  constexpr int kMr = T::kMr, kNr = T::kNr, kMaxKc = T::kMaxKc, kMc = kMaxMc / kMr * kMr;
  static_assert(kMaxKc <= kMaxKcAny && kNc % kNr == 0);
  Scratch& s = scratch();
  const int kc_step = kc_step_for<T>(k);
  // Equal row blocks of at most kMc, multiples of kMr: 128 rows as one block, not 72 + 56.
  const int m_blocks = (m + kMc - 1) / kMc;
  const int mc_step = std::min(kMc, ((m + m_blocks - 1) / m_blocks + kMr - 1) / kMr * kMr);
  for (int jc = 0; jc < n; jc += kNc) {
    const int nc = std::min(kNc, n - jc);
    for (int pc = 0; pc < k; pc += kc_step) {
      const int kc = std::min(kc_step, k - pc);
      const float beta_here = pc == 0 ? beta : 1.f;  // later k blocks add to the first's result
      for (int ic = 0; ic < m; ic += mc_step) {
        const int mc = std::min(mc_step, m - ic);
        for (int i = 0; i < mc && !pa.base; i += kMr) {
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
          // A whole panel of an untransposed b is read where it lies (b_in_place), else packed.
          const bool in_place = !trans_b && !pb.base && !source.fn && nr == kNr && b_in_place(ldb, m);
          if (ic == 0 && source.fn) source.fn(source.ctx, jc + j, nr, pc, kc, s.b + int64_t{j} * kc, kNr);
          else if (ic == 0 && !pb.base && !in_place)
            pack_b_panel(trans_b, b, ldb, jc + j, pc, kc, nr, kNr, s.b + int64_t{j} * kc);
          const bool fetch_next = ic == 0 && j + kNr < nc && !pb.base && !source.fn;
          const int tiles = (mc + kMr - 1) / kMr;
          for (int i = 0, t = 0; i < mc; i += kMr, ++t) {
            const int mr = std::min(kMr, mc - i);
            if (fetch_next) prefetch_panel(trans_b, b, ldb, jc + j + kNr, pc, kc, std::min(kNr, nc - j - kNr), t, tiles);
            float* out = c + int64_t{ic + i} * ldc + jc + j;
            const float* ap = pa.base ? pa.at(pc, ic + i, kc) : s.a + int64_t{i} * kc;
            const float* bp = pb.base    ? pb.at(pc, jc + j, kc)
                              : in_place ? b + int64_t{pc} * ldb + jc + j
                                         : s.b + int64_t{j} * kc;
            if (mr == kMr && nr == kNr) T::tile(kc, ap, bp, out, ldc, alpha, beta_here, in_place ? ldb : kNr);
            else edge_tile<T>(kc, ap, bp, out, ldc, mr, nr, alpha, beta_here, in_place ? ldb : kNr);
          }
        }
      }
    }
  }
}

// Useful share of the tiles' arithmetic for m rows and n columns (edge tiles computed whole, an edge
// panel of at most half the width as a half tile).
template <typename T>
double tile_use(int m, int n) {
  const int rest = n % T::kNr, cols = n - rest + (rest == 0 ? 0 : rest <= T::kNr / 2 ? T::kNr / 2 : T::kNr);
  return double(m) * n / (double((m + T::kMr - 1) / T::kMr * T::kMr) * cols);
}

// Whether products of m rows and n columns run transposed (c^T = op(b)^T op(a)^T into scratch, then
// written back across): a 7x7 map's 49 output columns fill 49 / 64 of two 32-column panels, but 49 /
// 56 of seven 8-row panels (one thread, 512 x 49 x 2048: 144 -> 165 GFLOP/s on the Zen 5). Only
// where that wastes clearly less and c^T is small.
template <typename T>
bool runs_transposed(int m, int n) {
  return int64_t{m} * n <= (int64_t{1} << 16) && tile_use<T>(n, m) > 1.08 * tile_use<T>(m, n);
}

// blocked_sgemm on T's tile, or on its seven-row form where T is the AVX-512 tile and sevens waste
// clearly fewer of the m rows (49: 49 against 56; 196: 196 against 200 is too close to pay).
template <typename T>
void rows_blocked_sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                        const float* b, int ldb, float beta, float* c, int ldc, Prepacked pb = {}) {
  if constexpr (std::is_same_v<T, Avx512Tile>) {
    if ((m + 6) / 7 * 7 * 1.04 < (m + 7) / 8 * 8) {
      blocked_sgemm<Avx512Tile7>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, {}, pb);
      return;
    }
  }
  blocked_sgemm<T>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, {}, pb);
}

// c[m, n] = ct^T + beta c, ct [n, m] (the transposed products' scratch): 8 x 8 blocks transposed in
// registers, the edges one by one.
MLXD_SGEMM_AVX2 void add_transposed(const float* ct, int m, int n, float beta, float* c, int ldc) {
  const __m256 vb = _mm256_set1_ps(beta);
  const int m8 = m / 8 * 8, n8 = n / 8 * 8;
  for (int j = 0; j < n8; j += 8)
    for (int i = 0; i < m8; i += 8) {
      __m256 r[8], t[8];
      for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(ct + size_t(j + q) * m + i);
      transpose8(r, t);  // t[q]: row i + q of c, columns j .. j + 7
      for (int q = 0; q < 8; ++q) {
        float* out = c + int64_t{i + q} * ldc + j;
        _mm256_storeu_ps(out, beta == 0.f ? t[q] : _mm256_fmadd_ps(vb, _mm256_loadu_ps(out), t[q]));  // as the tile's FMA
      }
    }
  for (int i = 0; i < m; ++i)
    for (int j = i < m8 ? n8 : 0; j < n; ++j) {
      float& out = c[int64_t{i} * ldc + j];
      const float v = ct[size_t(j) * m + i];
      out = beta == 0.f ? v : __builtin_fmaf(beta, out, v);
    }
}

// The transposed products' scratch, per thread, kept.
float* transposed_scratch(int m, int n) {
  thread_local std::vector<float> ct;
  if (ct.size() < size_t(m) * n) ct.resize(size_t(m) * n);  // never shrunk: regrowing zero-fills
  return ct.data();
}

template <typename T>
void tiled_sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (runs_transposed<T>(m, n)) {
    float* ct = transposed_scratch(m, n);
    rows_blocked_sgemm<T>(!trans_b, !trans_a, n, m, k, alpha, b, ldb, a, lda, 0.f, ct, m);
    add_transposed(ct, m, n, beta, c, ldc);
    return;
  }
  blocked_sgemm<T>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// c = beta c, without reading c when beta is 0 (no product to add: k 0 or alpha 0).
void scale_c(int m, int n, float beta, float* c, int ldc) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) c[int64_t{i} * ldc + j] = beta == 0.f ? 0.f : beta * c[int64_t{i} * ldc + j];
}

// A packed op(a)'s header (kPackHeader floats, so the panels stay 64-byte aligned where the buffer is).
struct PackHeader {
  int32_t magic, isa, transposed, m, k, width;
};
constexpr int32_t kPackMagic = 0x4b50584d;  // "MXPK"
constexpr int64_t kPackHeader = 16;

// Products written across (own_sgemm_packed_a_ct) take the transposed form unless its wasted tile work
// costs more than the other form's transposing pass over the result (written to scratch, then read and
// written across), which costs about as much as kAcrossPassSteps steps of k per element: so at small k
// nearly always. MobileNetV3's 240-channel expand at 28x28 (k 40, parts of 128 / 112 rows) ran 205 / 228
// us a part the other way, 131 / 113 transposed (the pass ~22 steps, an Ice Lake Xeon); its 480- and
// 672-channel expands at 14x14 (k 80 / 112): 300.3 -> 288.5 us a block transposed (Zen 4).
constexpr double kAcrossPassSteps = 16;

template <typename T>
void pack_a_as(int isa, int m, int k, int m_hint, int n_hint, bool across, const float* a, int lda, float* dst) {
  const bool transposed =
      across ? k / tile_use<T>(n_hint, m_hint) <= k / tile_use<T>(m_hint, n_hint) + kAcrossPassSteps
             : runs_transposed<T>(m_hint, n_hint);
  const int width = transposed ? T::kNr : T::kMr, kc_step = kc_step_for<T>(k);
  const PackHeader h{kPackMagic, isa, transposed, m, k, width};
  std::memcpy(dst, &h, sizeof h);
  float* panels = dst + kPackHeader;
  const int64_t stride = int64_t{(m + width - 1) / width} * width;
  for (int pc = 0; pc < k; pc += kc_step) {
    const int kc = std::min(kc_step, k - pc);
    for (int r = 0; r < m; r += width) {
      float* out = panels + pc * stride + int64_t{r} * kc;
      if (transposed) pack_b_panel(true, a, lda, r, pc, kc, std::min(width, m - r), width, out);
      else pack_gather(a + int64_t{r} * lda + pc, lda, std::min(width, m - r), kc, out, width, width);
    }
  }
}

template <typename T>
void packed_sgemm(const PackHeader& h, const float* panels, int r0, int m, bool trans_b, int n, float alpha,
                  const float* b, int ldb, float beta, float* c, int ldc) {
  const Prepacked p{panels, int64_t{(h.m + h.width - 1) / h.width} * h.width, r0};
  if (h.transposed) {
    float* ct = transposed_scratch(m, n);
    rows_blocked_sgemm<T>(!trans_b, false, n, m, h.k, alpha, b, ldb, nullptr, 0, 0.f, ct, m, p);
    add_transposed(ct, m, n, beta, c, ldc);
  } else {
    blocked_sgemm<T>(false, trans_b, m, n, h.k, alpha, nullptr, 0, b, ldb, beta, c, ldc, p, {});
  }
}

// The same product written across: ct[n, m] (row stride ldct) = (a[r0 : r0 + m] op(b))^T + beta ct. A
// transposed pack writes its tiles there directly; the other form goes through scratch.
template <typename T>
void packed_sgemm_ct(const PackHeader& h, const float* panels, int r0, int m, bool trans_b, int n, float alpha,
                     const float* b, int ldb, float beta, float* ct, int ldct) {
  const Prepacked p{panels, int64_t{(h.m + h.width - 1) / h.width} * h.width, r0};
  if (h.transposed) {
    rows_blocked_sgemm<T>(!trans_b, false, n, m, h.k, alpha, b, ldb, nullptr, 0, beta, ct, ldct, p);
  } else {
    float* c = transposed_scratch(m, n);
    blocked_sgemm<T>(false, trans_b, m, n, h.k, alpha, nullptr, 0, b, ldb, 0.f, c, n, p, {});
    add_transposed(c, n, m, beta, ct, ldct);  // ct[j, i] = c[i, j]
  }
}

}  // namespace

int own_sgemm_best() {
  static const int best = [] {
    __builtin_cpu_init();  // callable from static initializers (the front's default choice is one)
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
    return __builtin_cpu_supports("avx512f") ? kOwnAvx512 : kOwnAvx2;
  }();
  return best;
}

void own_sgemm(int isa, bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == 0.f) {
    scale_c(m, n, beta, c, ldc);
    return;
  }
  if (isa == kOwnAvx512) tiled_sgemm<Avx512Tile>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else tiled_sgemm<Avx2Tile>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void own_sgemm_b_source(int isa, int m, int n, int k, float alpha, const float* a, int lda, BPanelSource source,
                        float beta, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == 0.f) {
    scale_c(m, n, beta, c, ldc);
    return;
  }
  if (isa == kOwnAvx512)
    blocked_sgemm<Avx512Tile>(false, false, m, n, k, alpha, a, lda, nullptr, 0, beta, c, ldc, {}, {}, source);
  else blocked_sgemm<Avx2Tile>(false, false, m, n, k, alpha, a, lda, nullptr, 0, beta, c, ldc, {}, {}, source);
}

int64_t own_pack_a_floats(int m, int k) {
  // Rows rounded up to whole panels of any width: a multiple of the widest is not one of every width
  // (256 rows are 258 in panels of 6: the AVX2 tile's rows wrote past the pack's end).
  int64_t rows = 0;
  for (const int width : {Avx2Tile::kMr, Avx2Tile::kNr, Avx512Tile::kMr, Avx512Tile::kNr})
    rows = std::max<int64_t>(rows, (m + width - 1) / width * width);
  // + 8: pack_gather's vector stores run two floats past a 6-wide panel's end.
  return kPackHeader + rows * k + 8;
}

void own_pack_a(int isa, int m, int k, int m_hint, int n_hint, bool across, const float* a, int lda, float* dst) {
  if (isa == kOwnAvx512) pack_a_as<Avx512Tile>(isa, m, k, m_hint, n_hint, across, a, lda, dst);
  else pack_a_as<Avx2Tile>(isa, m, k, m_hint, n_hint, across, a, lda, dst);
}

int own_pack_a_isa(const float* pack) {
  PackHeader h;
  std::memcpy(&h, pack, sizeof h);
  return h.magic == kPackMagic ? h.isa : 0;
}

int own_pack_a_align(const float* pack) {
  PackHeader h;
  std::memcpy(&h, pack, sizeof h);
  return h.width;
}

namespace {
// Rows [r0, r0 + m) of a pack as a pack of their own, column p of each (a k index) times kscale[p]: the
// panels in the same k blocks, each block's panels of `width` rows [kc][width].
template <typename T>
void scaled_pack_as(const PackHeader& h, const float* panels, int r0, int m, const float* kscale, float* dst) {
  const int width = h.width, kc_step = kc_step_for<T>(h.k);
  const int64_t stride = int64_t{(h.m + width - 1) / width} * width;
  const int64_t out_stride = int64_t{(m + width - 1) / width} * width;
  PackHeader o = h;
  o.m = m;
  std::memcpy(dst, &o, sizeof o);
  float* out = dst + kPackHeader;
  for (int pc = 0; pc < h.k; pc += kc_step) {
    const int kc = std::min(kc_step, h.k - pc);
    for (int r = 0; r < m; r += width) {
      const float* src = panels + pc * stride + int64_t{r0 + r} * kc;
      float* d = out + pc * out_stride + int64_t{r} * kc;
      for (int p = 0; p < kc; ++p, src += width, d += width) {
        const float s = kscale[pc + p];
        for (int q = 0; q < width; ++q) d[q] = src[q] * s;
      }
    }
  }
}

// The products of rows [r0, r0 + m) on a pack, written as c (Across false) or across into ct: false when
// `pack` is not one of this tile's, holds another k, or the rows are outside it or not aligned.
template <bool Across>
bool run_packed(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b, int ldb,
                float beta, float* c, int ldc) {
  PackHeader h;
  std::memcpy(&h, pack, sizeof h);
  if (h.magic != kPackMagic || h.isa <= 0 || h.isa > own_sgemm_best() || h.k != k || r0 < 0 || m < 0 ||
      r0 + m > h.m || r0 % h.width != 0)
    return false;
  if (m == 0 || n <= 0) return true;
  if (h.k <= 0 || alpha == 0.f) {
    Across ? scale_c(n, m, beta, c, ldc) : scale_c(m, n, beta, c, ldc);
    return true;
  }
  const float* panels = pack + kPackHeader;
  if constexpr (Across) {
    if (h.isa == kOwnAvx512) packed_sgemm_ct<Avx512Tile>(h, panels, r0, m, trans_b, n, alpha, b, ldb, beta, c, ldc);
    else packed_sgemm_ct<Avx2Tile>(h, panels, r0, m, trans_b, n, alpha, b, ldb, beta, c, ldc);
  } else {
    if (h.isa == kOwnAvx512) packed_sgemm<Avx512Tile>(h, panels, r0, m, trans_b, n, alpha, b, ldb, beta, c, ldc);
    else packed_sgemm<Avx2Tile>(h, panels, r0, m, trans_b, n, alpha, b, ldb, beta, c, ldc);
  }
  return true;
}
}  // namespace

bool own_sgemm_packed_a(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b,
                        int ldb, float beta, float* c, int ldc) {
  return run_packed<false>(pack, r0, m, k, trans_b, n, alpha, b, ldb, beta, c, ldc);
}

bool own_pack_a_scaled(const float* pack, int r0, int m, const float* kscale, float* dst) {
  PackHeader h;
  std::memcpy(&h, pack, sizeof h);
  if (h.magic != kPackMagic || h.isa <= 0 || h.isa > own_sgemm_best() || r0 < 0 || m < 0 || r0 + m > h.m ||
      r0 % h.width != 0)
    return false;
  if (h.isa == kOwnAvx512) scaled_pack_as<Avx512Tile>(h, pack + kPackHeader, r0, m, kscale, dst);
  else scaled_pack_as<Avx2Tile>(h, pack + kPackHeader, r0, m, kscale, dst);
  return true;
}

bool own_sgemm_packed_a_ct(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b,
                           int ldb, float beta, float* ct, int ldct) {
  return run_packed<true>(pack, r0, m, k, trans_b, n, alpha, b, ldb, beta, ct, ldct);
}

#else  // not x86-64: the front keeps the loaded BLAS

int own_sgemm_best() { return 0; }
void own_sgemm(int, bool, bool, int, int, int, float, const float*, int, const float*, int, float, float*, int) {}
int64_t own_pack_a_floats(int, int) { return 0; }
void own_pack_a(int, int, int, int, int, bool, const float*, int, float*) {}
int own_pack_a_isa(const float*) { return 0; }
int own_pack_a_align(const float*) { return 1; }
bool own_sgemm_packed_a(const float*, int, int, int, bool, int, float, const float*, int, float, float*, int) {
  return false;
}
bool own_pack_a_scaled(const float*, int, int, const float*, float*) { return false; }
void own_sgemm_b_source(int, int, int, int, float, const float*, int, BPanelSource, float, float*, int) {}
bool own_sgemm_packed_a_ct(const float*, int, int, int, bool, int, float, const float*, int, float, float*, int) {
  return false;
}

#endif

}  // namespace mlxd::blas
