// Quantized GEMV on the CPU. Per output element and group g of K:
//   y[m, n] += scale[n, g] * dot(q[n, g], x[m, g]) + bias[n, g] * sum(x[m, g])
// The group sums of x are computed once per call; the dot products are the
// only per-weight work, so each packed word is unpacked once for up to
// kQgemvMaxRows rows of x (more rows run in such blocks). Rows of w (N) are
// split across the cores.
#include "kernels/qgemv_cpu.h"

#include "kernels/cpu_parallel.h"
#include "kernels/vec_math_cpu.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <pthread.h>
#include <time.h>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MLXD_QGEMV_X86 1
#endif

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

std::atomic<uint64_t> g_calls{0};
// The one-row eight-groups path (block_avx2_groups: groups of 32, 64 and 128); switchable for A/B
// measurements in one process.
std::atomic<bool> g_group32_path{true};
// Off by default: two in-process A/Bs of a 1.2B int4 decode at load 6 did not show it ahead (see
// docs/performance.md, 2026-11-26 11:05-11:31).
std::atomic<bool> g_guided_split{std::string(std::getenv("MLX_DELEGATE_QGEMV_GUIDED") ?: "") == "1"};
// The AVX-512 VNNI kernels (block_avx512*) where the CPU has them; off runs the AVX2 ones (A/B, parity).
std::atomic<bool> g_avx512_path{true};

// QgemvStats (qgemv_cpu.h), summed while cpu_pool_stats_enabled(). g_last_end_* are the previous call's
// end on the thread that ran it (0: no gap to count).
std::atomic<uint64_t> g_st_calls{0}, g_st_wall{0}, g_st_cpu{0}, g_st_parallel{0}, g_st_bytes{0}, g_st_gaps{0},
    g_st_gap_wall{0}, g_st_gap_cpu{0};
std::atomic<uint64_t> g_st_lead{0}, g_st_tail{0};
std::atomic<int64_t> g_last_end_wall{0}, g_last_end_cpu{0}, g_step_begin{0};
std::atomic<pthread_t> g_last_end_thread{};

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
int64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// Times one call's task when the stats are on: construct at its start, finish() around the product.
struct CallTimer {
  bool on = cpu_pool_stats_enabled();
  int64_t wall0 = 0, cpu0 = 0, par0 = 0;
  CallTimer() {
    if (!on) return;
    wall0 = wall_ns();
    cpu0 = thread_cpu_ns();
    const int64_t last = g_last_end_wall.exchange(0, std::memory_order_relaxed);
    if (last != 0 && pthread_equal(g_last_end_thread.load(std::memory_order_relaxed), pthread_self())) {
      g_st_gaps.fetch_add(1, std::memory_order_relaxed);
      g_st_gap_wall.fetch_add(wall0 - last, std::memory_order_relaxed);
      g_st_gap_cpu.fetch_add(cpu0 - g_last_end_cpu.load(std::memory_order_relaxed), std::memory_order_relaxed);
    } else if (const int64_t begin = g_step_begin.exchange(0, std::memory_order_relaxed); begin != 0) {
      g_st_lead.fetch_add(wall0 - begin, std::memory_order_relaxed);  // the step's first product
    }
  }
  void parallel_begin() {
    if (on) par0 = wall_ns();
  }
  void parallel_end() {
    if (on) g_st_parallel.fetch_add(wall_ns() - par0, std::memory_order_relaxed);
  }
  void finish(uint64_t bytes) {
    if (!on) return;
    const int64_t wall1 = wall_ns(), cpu1 = thread_cpu_ns();
    g_st_calls.fetch_add(1, std::memory_order_relaxed);
    g_st_wall.fetch_add(wall1 - wall0, std::memory_order_relaxed);
    g_st_cpu.fetch_add(cpu1 - cpu0, std::memory_order_relaxed);
    g_st_bytes.fetch_add(bytes, std::memory_order_relaxed);
    g_last_end_cpu.store(cpu1, std::memory_order_relaxed);
    g_last_end_thread.store(pthread_self(), std::memory_order_relaxed);
    g_last_end_wall.store(wall1, std::memory_order_relaxed);
  }
};

// How scales and biases are stored. They are read where they lie, one value per group of
// weights, never converted per call: GGUF's d and m are fp16, so a program keeps them fp16
// (exact) and the kernel reads half the bytes an fp32 copy would take.
enum ScaleKind : int { kScaleF32 = 0, kScaleF16 = 1, kScaleBF16 = 2 };
constexpr int kScaleKinds = 3;

int scale_kind(mx::Dtype d) { return d == mx::float16 ? kScaleF16 : d == mx::bfloat16 ? kScaleBF16 : kScaleF32; }

float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <int S>
inline float scale_portable(const void* p, int64_t i) {
  if constexpr (S == kScaleF16) return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
  else if constexpr (S == kScaleBF16) return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
  else return static_cast<const float*>(p)[i];
}

// Everything one call needs; workers read it, each writing its own columns of y.
struct Problem {
  const float* x;       // [M, K]
  const float* xsums;   // [M, G]: sum of x over each group
  const uint32_t* w;    // [N, K * bits / 32]
  const void* scales;   // [N, G], stored as ScaleKind
  const void* biases;   // [N, G], same kind
  float* y;             // [M, N]
  int64_t n_rows, k, groups, group_size, words_per_row;
  // The AVX2 kernel's activations (see quantize_x): x as int16 in blocks of
  // x_block elements, one scale per block, each 32 elements in load order.
  const int16_t* x16 = nullptr;  // [M, K]
  const float* x16_scales = nullptr;  // [M, K / x_block]
  int64_t x_block = 0;
};

// ---- Portable kernel: scalar, any M <= 8 -------------------------------------

template <int Bits, int M, int S>
void rows_portable(const Problem& p, int64_t n0, int64_t n1) {
  constexpr int per_word = 32 / Bits;
  constexpr uint32_t mask = (1u << Bits) - 1;
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* wn = p.w + n * p.words_per_row;
    float total[M] = {};
    for (int64_t g = 0; g < p.groups; ++g) {
      float acc[M] = {};
      const int64_t k0 = g * p.group_size;
      for (int64_t i = 0; i < p.group_size; ++i) {
        int64_t e = k0 + i;
        float q = static_cast<float>((wn[e / per_word] >> (Bits * (e % per_word))) & mask);
        for (int m = 0; m < M; ++m) acc[m] += q * p.x[m * p.k + e];
      }
      const float s = scale_portable<S>(p.scales, n * p.groups + g), b = scale_portable<S>(p.biases, n * p.groups + g);
      for (int m = 0; m < M; ++m) total[m] += s * acc[m] + b * p.xsums[m * p.groups + g];
    }
    for (int m = 0; m < M; ++m) p.y[m * p.n_rows + n] = total[m];
  }
}

// ---- AVX2 + FMA kernel: 8 weights per step, converted once for all M rows ----

#ifdef MLXD_QGEMV_X86

// AVX2 + FMA, and F16C for fp16 scales (every AVX2 CPU has it; pick_kernel checks).
#define MLXD_QGEMV_AVX2 __attribute__((target("avx2,fma,f16c")))

template <int S>
MLXD_QGEMV_AVX2 inline float scale_avx2(const void* p, int64_t i) {
  if constexpr (S == kScaleF16) return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  else return scale_portable<S>(p, i);
}

// The weights stay integers: x is rounded to int16 per block of x_block
// elements (scale = max|x| / 32767, so the rounding error is at most 2^-16 of
// the block's largest value, far below the weights' own quantization error),
// and 16 products at a time are summed exactly in int32 by vpmaddwd. That is
// 7 vector instructions per 32 weights where converting each weight to float
// for an FMA takes 16. Within each 32 elements x is stored in the order the
// packed weights unpack in: for int4, 16 bytes widened to 16-bit lanes give
// the even elements as low nibbles and the odd ones as high nibbles.
constexpr int16_t kX16Max = 32767;

// A block holds at most 128 elements: int32 sums then stay below 2^31 for
// int8 weights (4 chunks x 2 vpmaddwd x 2 x 255 x 32767).
int64_t x_block_for(int64_t group_size) {
  for (int64_t b : {128, 64, 32})
    if (group_size % b == 0) return b;
  return 0;
}

// Within each `span` elements (32 for the AVX2 kernels, 64 for the AVX-512 ones) x is stored in
// the order the packed weights widen into 16-bit lanes: int8 in order; int4 byte j of a span
// holds elements 2j (low nibble) and 2j + 1 (high), so slot j < span / 2 holds element 2j and
// slot span / 2 + j element 2j + 1.
template <int Bits>
inline int64_t x_slot_element(int64_t span, int64_t i) {
  if constexpr (Bits == 8) return i;
  const int64_t half = span / 2;
  return 2 * (i % half) + (i >= half);
}

template <int Bits>
void quantize_x(const float* x, int64_t m, int64_t k, int64_t block, int64_t span, int16_t* q, float* scales) {
  std::vector<float> inv(static_cast<size_t>(k / block));
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    for (int64_t b0 = 0; b0 < k; b0 += block) {
      float amax = 0.f;
      for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xr[b0 + i]));
      scales[(r * k + b0) / block] = amax / kX16Max;
      inv[b0 / block] = amax > 0.f ? kX16Max / amax : 0.f;
    }
    // A span may hold several blocks (span 64, groups of 32): each element takes its own block's scale.
    for (int64_t s0 = 0; s0 < k; s0 += span)
      for (int64_t i = 0; i < span; ++i) {
        const int64_t e = s0 + x_slot_element<Bits>(span, i);
        q[r * k + s0 + i] = static_cast<int16_t>(std::lrintf(xr[e] * inv[e / block]));
      }
  }
}

// 32 weights of one row from element e (a multiple of 32) as two vectors of
// 16-bit lanes, in the order quantize_x stores x.
template <int Bits>
MLXD_QGEMV_AVX2 inline void load_w32(const uint32_t* wn, int64_t e, __m256i& lo, __m256i& hi) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(wn);
  if constexpr (Bits == 4) {
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + e / 2)));
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(v, 4);
  } else {
    lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + e)));
    hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + e + 16)));
  }
}

// Outputs (rows of w) per pass by row count of x: with one or two rows of x,
// several outputs share each load of x (1.2B int4 decode 19.7 tok/s with four
// at one row, 17.3 with one).
template <int M>
constexpr int kBlockRows = M == 1 ? 4 : M == 2 ? 2 : 1;

// Outputs n0 .. n0 + NB of every row of x.
template <int Bits, int M, int NB, int S>
MLXD_QGEMV_AVX2 void block_avx2(const Problem& p, int64_t n0) {
  const uint32_t* wn[NB];
  for (int j = 0; j < NB; ++j) wn[j] = p.w + (n0 + j) * p.words_per_row;
  __m256 total[M][NB];
  float bias_part[M][NB] = {};
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) total[m][j] = _mm256_setzero_ps();
  const int64_t blocks_per_group = p.group_size / p.x_block, blocks_per_row = p.k / p.x_block;
  for (int64_t g = 0; g < p.groups; ++g) {
    float sw[NB];
    for (int j = 0; j < NB; ++j) sw[j] = scale_avx2<S>(p.scales, (n0 + j) * p.groups + g);
    for (int64_t xb = g * blocks_per_group; xb < (g + 1) * blocks_per_group; ++xb) {
      __m256i acc[M][NB];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_si256();
      for (int64_t e = xb * p.x_block; e < (xb + 1) * p.x_block; e += 32) {
        __m256i xlo[M], xhi[M];
        for (int m = 0; m < M; ++m) {
          xlo[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x16 + m * p.k + e));
          xhi[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x16 + m * p.k + e + 16));
        }
        for (int j = 0; j < NB; ++j) {
          // The same columns of the next block's rows, one prefetch per cache
          // line: the hardware prefetcher follows NB short interleaved row
          // streams poorly (1.2B int4 decode 15.2 -> 19.7 tok/s with this).
          if (e % (512 / Bits) == 0)
            _mm_prefetch(reinterpret_cast<const char*>(wn[j] + NB * p.words_per_row) + e * Bits / 8, _MM_HINT_T0);
          __m256i lo, hi;
          load_w32<Bits>(wn[j], e, lo, hi);
          for (int m = 0; m < M; ++m)
            acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_add_epi32(_mm256_madd_epi16(lo, xlo[m]),
                                                                     _mm256_madd_epi16(hi, xhi[m])));
        }
      }
      for (int m = 0; m < M; ++m) {
        const float sx = p.x16_scales[m * blocks_per_row + xb];
        for (int j = 0; j < NB; ++j)
          total[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][j]), _mm256_set1_ps(sx * sw[j]), total[m][j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const float b = scale_avx2<S>(p.biases, (n0 + j) * p.groups + g);
      for (int m = 0; m < M; ++m) bias_part[m][j] += b * p.xsums[m * p.groups + g];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) p.y[m * p.n_rows + n0 + j] = vmath::hsum8(total[m][j]) + bias_part[m][j];
}

// ---- One row of x, groups of 32 / 64 / 128: eight groups per scale step --

// The eight sums of eight int32 vectors, lane i the total of a[i].
MLXD_QGEMV_AVX2 inline __m256i sums_of_8(const __m256i a[8]) {
  const __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);  // halves of a0-a3, a4-a7
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// Eight consecutive scales / biases as float32.
template <int S>
MLXD_QGEMV_AVX2 inline __m256 load8_scales(const void* p, int64_t i) {
  if constexpr (S == kScaleF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (S == kScaleF16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// One group's integer dot product from element e0 (GS weights of one row against x), 8 int32 lanes
// (each at most 4 x 255 x 32767 x GS / 32: no overflow up to GS 128).
template <int Bits, int GS>
MLXD_QGEMV_AVX2 inline __m256i group_dot(const Problem& p, const uint32_t* wn, int64_t e0) {
  __m256i acc = _mm256_setzero_si256();
  for (int64_t e = e0; e < e0 + GS; e += 32) {
    __m256i lo, hi;
    load_w32<Bits>(wn, e, lo, hi);
    const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x16 + e));
    const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x16 + e + 16));
    acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(lo, xlo), _mm256_madd_epi16(hi, xhi)));
  }
  return acc;
}

// Outputs n0 .. n0 + NB of a decode step (one row of x) when a group of GS weights (32, 64 or 128) is
// one x block. The per-group path scales each group's integer dot product on its own (a convert, a
// broadcast product and an FMA per group and output, and a scalar bias term); here the dot
// products of eight groups are reduced into one vector and scaled, biased and accumulated with
// one vector op each: fewer instructions per weight where a step reads every weight once (groups
// of 64 on the AVX2-only Zen 3: 7.8 GB/s per product on the per-group path, against 14.5 for 32).
template <int Bits, int NB, int S, int GS>
MLXD_QGEMV_AVX2 void block_avx2_groups(const Problem& p, int64_t n0) {
  constexpr int64_t kChunk = 8 * GS;  // elements per eight groups
  constexpr int64_t kLine = 512 / Bits;  // elements per 64-byte line of packed weights
  const int64_t chunks = p.groups / 8;
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + j;
    const uint32_t* wn = p.w + n * p.words_per_row;
    const void* scales = p.scales;
    __m256 total = _mm256_setzero_ps(), bias = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t e0 = c * kChunk;
      // The same columns NB rows on: the next block's (see block_avx2).
      for (int64_t e = e0; e < e0 + kChunk; e += kLine)
        _mm_prefetch(reinterpret_cast<const char*>(wn + NB * p.words_per_row) + e * Bits / 8, _MM_HINT_T0);
      __m256i acc[8];
      for (int g = 0; g < 8; ++g) acc[g] = group_dot<Bits, GS>(p, wn, e0 + GS * g);
      const int64_t g0 = n * p.groups + 8 * c;
      const __m256 scale = _mm256_mul_ps(load8_scales<S>(scales, g0), _mm256_loadu_ps(p.x16_scales + 8 * c));
      total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_of_8(acc)), scale, total);
      bias = _mm256_fmadd_ps(load8_scales<S>(p.biases, g0), _mm256_loadu_ps(p.xsums + 8 * c), bias);
    }
    float y = vmath::hsum8(_mm256_add_ps(total, bias));
    for (int64_t g = chunks * 8; g < p.groups; ++g) {  // the last groups % 8, one at a time
      const float dot = static_cast<float>(vmath::hsum8(_mm256_cvtepi32_ps(group_dot<Bits, GS>(p, wn, GS * g))));
      y += dot * p.x16_scales[g] * scale_avx2<S>(scales, n * p.groups + g) +
           scale_avx2<S>(p.biases, n * p.groups + g) * p.xsums[g];
    }
    p.y[n] = y;
  }
}

template <int Bits, int NB, int S, int GS>
MLXD_QGEMV_AVX2 void rows_avx2_groups(const Problem& p, int64_t n, int64_t n1) {
  for (; n + NB <= n1; n += NB) block_avx2_groups<Bits, NB, S, GS>(p, n);
  for (; n < n1; ++n) block_avx2_groups<Bits, 1, S, GS>(p, n);
}

template <int Bits, int M, int S>
MLXD_QGEMV_AVX2 void rows_avx2(const Problem& p, int64_t n0, int64_t n1) {
  constexpr int NB = kBlockRows<M>;
  int64_t n = n0;
  // One row, a group one x block: eight groups at a time.
  if (M == 1 && p.group_size == p.x_block && g_group32_path.load(std::memory_order_relaxed)) {
    switch (p.group_size) {
      case 32: return rows_avx2_groups<Bits, NB, S, 32>(p, n, n1);
      case 64: return rows_avx2_groups<Bits, NB, S, 64>(p, n, n1);
      case 128: return rows_avx2_groups<Bits, NB, S, 128>(p, n, n1);
      default: break;
    }
  }
  for (; n + NB <= n1; n += NB) block_avx2<Bits, M, NB, S>(p, n);
  for (; n < n1; ++n) block_avx2<Bits, M, 1, S>(p, n);
}

#include "kernels/qgemv_cpu_avx512.inc"

#endif

// ---- Kernel table: [scale kind][bits is 8][rows - 1] ---------------------------

using RowsFn = void (*)(const Problem&, int64_t, int64_t);

template <template <int, int, int> class Pick, int Bits, int S, int... Ms>
constexpr std::array<RowsFn, sizeof...(Ms)> row_table(std::integer_sequence<int, Ms...>) {
  return {Pick<Bits, Ms + 1, S>::fn...};
}

template <int Bits, int M, int S>
struct Portable {
  static constexpr RowsFn fn = rows_portable<Bits, M, S>;
};
#ifdef MLXD_QGEMV_X86
template <int Bits, int M, int S>
struct Avx2 {
  static constexpr RowsFn fn = rows_avx2<Bits, M, S>;
};
template <int Bits, int M, int S>
struct Avx512 {
  static constexpr RowsFn fn = rows_avx512<Bits, M, S>;
};
#endif

using BitsTable = std::array<std::array<RowsFn, kQgemvMaxRows>, 2>;

template <template <int, int, int> class Pick, int S>
constexpr BitsTable bits_table() {
  auto rows = std::make_integer_sequence<int, kQgemvMaxRows>{};
  return {row_table<Pick, 4, S>(rows), row_table<Pick, 8, S>(rows)};
}

template <template <int, int, int> class Pick>
constexpr std::array<BitsTable, kScaleKinds> kernel_table() {
  return {bits_table<Pick, kScaleF32>(), bits_table<Pick, kScaleF16>(), bits_table<Pick, kScaleBF16>()};
}

bool use_avx2_kernels() {
#ifdef MLXD_QGEMV_X86
  static const bool on = cpu_use_avx2() && __builtin_cpu_supports("f16c");
  return on;
#else
  return false;
#endif
}

bool cpu_has_avx512_vnni() {
#ifdef MLXD_QGEMV_X86
  static const bool on = use_avx2_kernels() && cpu_use_avx512() && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return on;
#else
  return false;
#endif
}

enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// Which kernels run a problem of m rows; the x layout (quantize_x's span) follows. AVX-512 takes
// x blocks of 64 and up (k a multiple of 64 then), and groups of 32 at one row where k is a
// multiple of 64 and the one-row group-32 path is on.
Isa pick_isa(int64_t m, int64_t k, int64_t x_block) {
  if (!use_avx2_kernels()) return kPortable;
  if (cpu_has_avx512_vnni() && g_avx512_path.load(std::memory_order_relaxed) && k % 64 == 0 &&
      (x_block >= 64 || (x_block == 32 && m == 1 && g_group32_path.load(std::memory_order_relaxed))))
    return kAvx512;
  return kAvx2;
}

RowsFn pick_kernel(Isa isa, int scales, int bits, int64_t m) {
  static const std::array<std::array<BitsTable, kScaleKinds>, 3> table = {
      kernel_table<Portable>(),
#ifdef MLXD_QGEMV_X86
      kernel_table<Avx2>(), kernel_table<Avx512>(),
#else
      kernel_table<Portable>(), kernel_table<Portable>(),
#endif
  };
  return table[isa][scales][bits == 8][m - 1];
}

// ---- Rows of w (N) split across the cores (the shared pool in cpu_parallel.h) --

// Problem p from row r0 of x on.
Problem from_row(Problem p, int64_t r0) {
  p.x += r0 * p.k;
  p.xsums += r0 * p.groups;
  if (p.x16) {
    p.x16 += r0 * p.k;
    p.x16_scales += r0 * (p.k / p.x_block);
  }
  p.y += r0 * p.n_rows;
  return p;
}

// Outputs per chunk when x has more rows than one kernel pass takes: every
// block of kQgemvMaxRows rows runs over the chunk while its weights are still
// in the core's cache.
constexpr int64_t kRowsChunk = 64;

// The decode GEMV streams its weights once, so the cores finish together only if the last pieces
// are small: a helper that starts late (or is preempted) on a shared machine otherwise leaves the
// other thread a whole equal part to do alone at the end. Each thread claims, from one counter,
// a share of what is left (1 / (2 x threads) of the remaining rows, so the pieces shrink as the
// product ends), never more than 1 / (8 x threads) of all rows (half the equal split's part: a
// thread preempted while it holds a piece strands less) and down to kGuidedMinRows rows (about
// 32 KiB of int4 weights at K 2048), in multiples of 4 rows (the kernels' row block).
constexpr int64_t kGuidedMinRows = 32;

template <class Fn>
void guided_rows(int64_t n, int64_t cost_per_row, const Fn& fn) {
  const int threads = cpu_pool_threads();
  if (threads <= 1 || n * cost_per_row < kCpuMinParallel || n <= kGuidedMinRows) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  cpu_parallel_parts(threads, [&](int) {
    int64_t begin = next.load(std::memory_order_relaxed), end;
    for (;;) {
      do {
        if (begin >= n) return;
        int64_t chunk = std::max(kGuidedMinRows, std::min((n - begin) / (2 * threads), n / (8 * threads)));
        chunk = (chunk + 3) / 4 * 4;
        end = std::min(n, begin + chunk);
      } while (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed));
      fn(begin, end);
      begin = next.load(std::memory_order_relaxed);
    }
  });
}

void run_problem(Problem p, int scales, int bits, int64_t m) {
  std::vector<int16_t> x16;
  std::vector<float> x16_scales;
  Isa isa = kPortable;
#ifdef MLXD_QGEMV_X86
  if (use_avx2_kernels()) {
    p.x_block = x_block_for(p.group_size);
    isa = pick_isa(m, p.k, p.x_block);
    x16.resize(static_cast<size_t>(m * p.k));
    x16_scales.resize(static_cast<size_t>(m * p.k / p.x_block));
    if (isa == kAvx512)
      (bits == 4 ? quantize_x_avx512<4> : quantize_x_avx512<8>)(p.x, m, p.k, p.x_block, x16.data(), x16_scales.data());
    else
      (bits == 4 ? quantize_x<4> : quantize_x<8>)(p.x, m, p.k, p.x_block, 32, x16.data(), x16_scales.data());
    p.x16 = x16.data();
    p.x16_scales = x16_scales.data();
  }
#endif
  if (m <= kQgemvMaxRows) {
    if (isa == kAvx512) cpu_kernel_note_call("qgemv_avx512");  // tests prove the AVX-512 kernels ran
    RowsFn kernel = pick_kernel(isa, scales, bits, m);
    if (g_guided_split.load(std::memory_order_relaxed))
      guided_rows(p.n_rows, p.k * m, [&](int64_t begin, int64_t end) { kernel(p, begin, end); });
    else
      cpu_parallel_for(p.n_rows, p.k * m, 4, [&](int64_t begin, int64_t end) { kernel(p, begin, end); });
    return;
  }
  if (isa == kAvx512) cpu_kernel_note_call("qgemv_avx512");
  cpu_parallel_for(p.n_rows, p.k * m, kRowsChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowsChunk)
      for (int64_t r0 = 0; r0 < m; r0 += kQgemvMaxRows) {
        const int64_t rows = std::min(kQgemvMaxRows, m - r0);
        pick_kernel(isa, scales, bits, rows)(from_row(p, r0), n0, std::min(end, n0 + kRowsChunk));
      }
  });
}

// ---- The epilogue (QgemvEpilogue): a GLU and a residual add on the finished product ----

float silu1(float v) { return v / (1.f + std::exp(-v)); }

#ifdef MLXD_QGEMV_X86
MLXD_QGEMV_AVX2 void glu_avx2(const float* g, const float* u, float* o, int64_t h) {
  int64_t i = 0;
  for (; i + 8 <= h; i += 8)
    _mm256_storeu_ps(o + i, _mm256_mul_ps(vmath::silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
  for (; i < h; ++i) o[i] = silu1(g[i]) * u[i];
}
#endif

// out[r, i] = silu(full[r, i]) * full[r, h + i] for each of m rows of 2h products.
void glu_rows(const float* full, float* out, int64_t m, int64_t h) {
  for (int64_t r = 0; r < m; ++r) {
    const float *g = full + r * 2 * h, *u = g + h;
    float* o = out + r * h;
#ifdef MLXD_QGEMV_X86
    if (use_avx2_kernels()) {
      glu_avx2(g, u, o, h);
      continue;
    }
#endif
    for (int64_t i = 0; i < h; ++i) o[i] = silu1(g[i]) * u[i];
  }
}

// x / sqrt(mean(x^2) + eps) * weight for each of m rows of k, in float32 (MLX's rms_norm accumulates so).
void rms_rows(const float* x, const float* weight, float eps, int64_t m, int64_t k, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float ss = 0.f;
    for (int64_t i = 0; i < k; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(k) + eps);
    for (int64_t i = 0; i < k; ++i) out[r * k + i] = xr[i] * inv * weight[i];
  }
}

// ---- The MLX primitive --------------------------------------------------------

const ChainableKernel kQGemvCpuChainable{"QGemvCpu"};  // kernel_chain.h

class QGemvCpu : public QuantizedProductCpu {
 public:
  // Inputs past the four operands: the residual, then the norm's weight, each where present.
  // out: x's shape with N (or N / 2) last; view: in[0] is the array x is a reshape of.
  QGemvCpu(mx::Stream s, int group_size, int bits, bool glu, int residual_at, int norm_at, float eps, mx::Shape out,
           bool view)
      : QuantizedProductCpu(s, "QGemvCpu", group_size, bits), glu_(glu), view_(view), residual_at_(residual_at),
        norm_at_(norm_at), eps_(eps), out_(std::move(out)) {}

  bool is_equivalent(const mx::Primitive& other) const override {
    if (!QuantizedProductCpu::is_equivalent(other)) return false;
    const auto& o = static_cast<const QGemvCpu&>(other);
    return o.glu_ == glu_ && o.view_ == view_ && o.out_ == out_ && o.residual_at_ == residual_at_ && o.norm_at_ == norm_at_ && o.eps_ == eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override { return {out_}; }

  // inputs: x [..., K] (float32 / bfloat16 / float16; or an array x is a reshape of, read in order as
  // [M, K]), w [N, K * bits / 32] uint32, scales and biases [N, G] (one float dtype, read as stored),
  // optionally a residual of the output's shape; any layout. Output [..., N] float32 ([..., N / 2] with the GLU).
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const int64_t n = in[1].shape(0), k = in[1].shape(1) * 32 / bits_, m = static_cast<int64_t>(in[0].size()) / k;
    Problem p{nullptr, nullptr, nullptr, nullptr, nullptr, out.data<float>(), n, k, k / group_size_, group_size_,
              in[1].shape(1)};
    g_calls.fetch_add(1, std::memory_order_relaxed);
    if (view_) cpu_kernel_note_call("qgemv_reshaped_input");
    encoder.dispatch([p, m, bits = bits_, glu = glu_, residual_at = residual_at_, norm_at = norm_at_, eps = eps_,
                      in]() mutable {
      CallTimer timer;
      F32RowMajor x(in[0]);
      auto row_major = [](const mx::array& a) {
        return CpuRowMajor(a.data<void>(), a.itemsize(), a.shape(), a.strides(), a.flags().row_contiguous);
      };
      CpuRowMajor w = row_major(in[1]), scales = row_major(in[2]), biases = row_major(in[3]);
      std::vector<float> xsums(static_cast<size_t>(m * p.groups));
      p.x = x.data();
      std::vector<float> normed;
      if (norm_at >= 0) {
        F32RowMajor weight(in[norm_at]);
        normed.resize(static_cast<size_t>(m * p.k));
        rms_rows(p.x, weight.data(), eps, m, p.k, normed.data());
        p.x = normed.data();
      }
#ifdef MLXD_QGEMV_X86
      if (cpu_has_avx512_vnni())
        for (int64_t r = 0; r < m; ++r) group_sums_avx512(p.x + r * p.k, p.k, p.group_size, &xsums[r * p.groups]);
      else
#endif
      for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < p.groups; ++g) {
          const float* xg = p.x + r * p.k + g * p.group_size;
          float s = 0.f;
          for (int64_t i = 0; i < p.group_size; ++i) s += xg[i];
          xsums[r * p.groups + g] = s;
        }
      p.xsums = xsums.data();
      p.w = static_cast<const uint32_t*>(w.data());
      p.scales = scales.data();
      p.biases = biases.data();
      float* y = p.y;
      std::vector<float> full;  // the GLU's whole product; its halves make y
      if (glu) {
        full.resize(static_cast<size_t>(m * p.n_rows));
        p.y = full.data();
      }
      timer.parallel_begin();
      run_problem(p, scale_kind(in[2].dtype()), bits, m);
      timer.parallel_end();
      const int64_t width = glu ? p.n_rows / 2 : p.n_rows;
      if (glu) glu_rows(full.data(), y, m, width);
      if (residual_at >= 0) {
        F32RowMajor r(in[residual_at]);
        const float* rd = r.data();
        for (int64_t i = 0; i < m * width; ++i) y[i] += rd[i];
      }
      timer.finish(in[1].nbytes() + in[2].nbytes() + in[3].nbytes());
    });
  }

 private:
  bool glu_, view_;
  int residual_at_, norm_at_;
  float eps_;
  mx::Shape out_;
};

}  // namespace

bool quantized_layout_ok(const mx::array& x, int group_size, int bits) {
  if ((bits != 4 && bits != 8) || group_size <= 0 || group_size % 32 != 0) return false;
  return x.ndim() > 0 && x.shape(-1) > 0 && x.shape(-1) % group_size == 0;
}

void check_quantized_operands(const char* who, const mx::array& x, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits) {
  const std::string name(who);
  const int k = x.shape(-1), n = w.shape(0), groups = k / group_size;
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || static_cast<int64_t>(w.shape(1)) * 32 != int64_t{k} * bits)
    throw std::invalid_argument(name + ": packed weights do not match x's last axis");
  mx::Shape side{n, groups};
  if (scales.shape() != side || biases.shape() != side)
    throw std::invalid_argument(name + ": scales and biases must be [N, K / group_size]");
  for (const auto* a : {&scales, &biases})
    if (!mx::issubdtype(a->dtype(), mx::floating) || a->dtype() == mx::float64)
      throw std::invalid_argument(name + ": scales and biases must be float32, bfloat16 or float16");
  if (scales.dtype() != biases.dtype()) throw std::invalid_argument(name + ": scales and biases must have one dtype");
}

bool qgemv_cpu_applies(const mx::array& x, int group_size, int bits) {
  if (!cpu_kernels_active() || !cpu_kernel_dtype_ok(x) || !quantized_layout_ok(x, group_size, bits)) return false;
  int64_t rows = static_cast<int64_t>(x.size()) / x.shape(-1);
  // The integer AVX2 kernel takes any number of rows (blocks of kQgemvMaxRows over cached
  // chunks of w); the portable loop only decode-sized products.
  return rows >= 1 && (rows <= kQgemvMaxRows || use_avx2_kernels());
}

mx::array qgemv_cpu(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                    int group_size, int bits, const QgemvEpilogue& epilogue) {
  check_quantized_operands("qgemv_cpu", x, w, scales, biases, group_size, bits);
  if (epilogue.glu && w.shape(0) % 2)
    throw std::invalid_argument("qgemv_cpu: a GLU needs an even number of outputs, got " +
                                std::to_string(w.shape(0)));
  auto shape = x.shape();
  shape.back() = epilogue.glu ? w.shape(0) / 2 : w.shape(0);
  // x a reshape of y (attention's merged heads): y goes in (one graph node fewer). By name: libmlx
  // exports no type info for its primitives.
  const bool view = x.has_primitive() && std::strcmp(x.primitive().name(), "Reshape") == 0;
  std::vector<mx::array> inputs{view ? x.inputs()[0] : x, w, scales, biases};
  if (epilogue.residual) {
    if (epilogue.residual->shape() != shape || !mx::issubdtype(epilogue.residual->dtype(), mx::floating) ||
        epilogue.residual->dtype() == mx::float64)
      throw std::invalid_argument("qgemv_cpu: the residual must be a float32 / bfloat16 / float16 array of the "
                                  "output's shape");
    inputs.push_back(*epilogue.residual);
  }
  const int residual_at = epilogue.residual ? 4 : -1;
  int norm_at = -1;
  if (epilogue.norm_weight) {
    const auto& nw = *epilogue.norm_weight;
    if (nw.ndim() != 1 || nw.shape(0) != x.shape(-1) || !mx::issubdtype(nw.dtype(), mx::floating) ||
        nw.dtype() == mx::float64)
      throw std::invalid_argument("qgemv_cpu: the norm weight must be a float vector as long as x's last axis");
    norm_at = static_cast<int>(inputs.size());
    inputs.push_back(nw);
  }
  auto prim = std::make_shared<QGemvCpu>(mx::default_stream(mx::Device::cpu), group_size, bits, epilogue.glu,
                                         residual_at, norm_at, epilogue.norm_eps, shape, view);
  return mx::array(std::move(shape), mx::float32, std::move(prim), std::move(inputs));
}

uint64_t qgemv_cpu_calls() { return g_calls.load(std::memory_order_relaxed); }

void qgemv_cpu_set_group32_path(bool on) { g_group32_path.store(on, std::memory_order_relaxed); }
void qgemv_cpu_set_guided_split(bool on) { g_guided_split.store(on, std::memory_order_relaxed); }
bool qgemv_cpu_guided_split() { return g_guided_split.load(std::memory_order_relaxed); }
void qgemv_cpu_set_avx512_path(bool on) { g_avx512_path.store(on, std::memory_order_relaxed); }
#ifdef MLXD_QGEMV_X86
int qgemv_cpu_set_one_row_block(int rows) { return g_one_row_block.exchange(one_row_rows(rows)); }
#else
int qgemv_cpu_set_one_row_block(int) { return 1; }
#endif

QgemvStats qgemv_cpu_stats() {
  return {g_st_calls.load(), g_st_wall.load(), g_st_cpu.load(),      g_st_parallel.load(), g_st_bytes.load(),
          g_st_gaps.load(),  g_st_gap_wall.load(), g_st_gap_cpu.load(), g_st_lead.load(),   g_st_tail.load()};
}

void qgemv_cpu_reset_stats() {
  for (auto* c : {&g_st_calls, &g_st_wall, &g_st_cpu, &g_st_parallel, &g_st_bytes, &g_st_gaps, &g_st_gap_wall,
                  &g_st_gap_cpu, &g_st_lead, &g_st_tail})
    c->store(0);
  g_last_end_wall.store(0, std::memory_order_relaxed);
  g_step_begin.store(0, std::memory_order_relaxed);
}

void qgemv_cpu_step_begin() {
  g_last_end_wall.store(0, std::memory_order_relaxed);
  g_step_begin.store(wall_ns(), std::memory_order_relaxed);
}

void qgemv_cpu_step_end() {
  if (const int64_t last = g_last_end_wall.load(std::memory_order_relaxed); last != 0)
    g_st_tail.fetch_add(wall_ns() - last, std::memory_order_relaxed);
  g_step_begin.store(0, std::memory_order_relaxed);
}

}  // namespace mlxd::rt
