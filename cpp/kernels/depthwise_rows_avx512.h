// Depthwise output rows from zero-bordered input rows, each input row read once per block (AVX-512F):
// shared by the inverted-residual block's depthwise (block_depthwise_cpu.cpp) and the standalone
// depthwise convolution (conv_depthwise_cpu.cpp). Loading every tap's sixteen columns unaligned was one
// line-crossing load per FMA, which held 5x5 rows to ~40 % of the FMA bound. Here a block of R output rows
// by V vectors of sixteen columns reads each of its input rows as whole vectors, forms the K tap windows
// in registers (valignd), and feeds each window to every output row whose window covers that input row:
// 5x5 at stride 1 in a C++ microbenchmark 28 -> 48 G multiply-adds a second a thread. The sum order is the
// plain loop's (the bias, then the taps row by row). Internal to the kernels.
#pragma once

#include <cstdint>

#include "kernels/vec_math_cpu.h"

#ifdef MLXD_CPU_X86
namespace mlxd::rt::dw_rows {

// acc + *w * x, the weight broadcast from memory by the FMA itself: as _mm512_set1_ps, GCC keeps a 5x5
// window's 25 broadcasts in registers and spills the accumulators (26 against 48 G multiply-adds a second).
MLXD_AVX512 [[gnu::always_inline]] inline __m512 fma_bcast(const float* w, __m512 x, __m512 acc) {
  asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*w));
  return acc;
}

// Lanes N .. N + 15 of the 32 floats lo, hi.
template <int N>
MLXD_AVX512 [[gnu::always_inline]] inline __m512 align_n(__m512 lo, __m512 hi) {
  return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(hi), _mm512_castps_si512(lo), N));
}

// The same for n 0..6, a constant once inlined (valignd takes an immediate).
MLXD_AVX512 [[gnu::always_inline]] inline __m512 shift(__m512 lo, __m512 hi, int n) {
  switch (n) {
    case 1: return align_n<1>(lo, hi);
    case 2: return align_n<2>(lo, hi);
    case 3: return align_n<3>(lo, hi);
    case 4: return align_n<4>(lo, hi);
    case 5: return align_n<5>(lo, hi);
    case 6: return align_n<6>(lo, hi);
    default: return lo;
  }
}

// Where sixteen outputs' tap windows lie in one padded input row. p: the row at the first output's first
// input; x[kj]: tap column kj's window. kStep: floats between vectors of sixteen outputs.
struct Contiguous {  // stride 1
  static constexpr int kStep = 16;
  template <int K>
  MLXD_AVX512 [[gnu::always_inline]] static void windows(const float* p, int64_t, __m512* x) {
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
#pragma GCC unroll 8
    for (int kj = 0; kj < K; ++kj) x[kj] = shift(a, b, kj);
  }
};

struct Interleaved2 {  // stride 2, the row as it is: tap kj = 2m (+1) reads the even (odd) columns from m on
  static constexpr int kStep = 32;
  template <int K>
  MLXD_AVX512 [[gnu::always_inline]] static void windows(const float* p, int64_t, __m512* x) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512 a0 = _mm512_loadu_ps(p), a1 = _mm512_loadu_ps(p + 16);
    const __m512 b0 = _mm512_loadu_ps(p + 32), b1 = _mm512_loadu_ps(p + 48);
    const __m512 e0 = _mm512_permutex2var_ps(a0, even, a1), o0 = _mm512_permutex2var_ps(a0, odd, a1);
    const __m512 e1 = _mm512_permutex2var_ps(b0, even, b1), o1 = _mm512_permutex2var_ps(b0, odd, b1);
#pragma GCC unroll 8
    for (int kj = 0; kj < K; ++kj) x[kj] = kj % 2 ? shift(o0, o1, kj / 2) : shift(e0, e1, kj / 2);
  }
};

struct SplitHalves2 {  // stride 2, the row stored as its even columns, then its odd ones `half` floats on
  static constexpr int kStep = 16;
  template <int K>
  MLXD_AVX512 [[gnu::always_inline]] static void windows(const float* p, int64_t half, __m512* x) {
    const __m512 e0 = _mm512_loadu_ps(p), e1 = _mm512_loadu_ps(p + 16);
    const __m512 o0 = _mm512_loadu_ps(p + half), o1 = _mm512_loadu_ps(p + half + 16);
#pragma GCC unroll 8
    for (int kj = 0; kj < K; ++kj) x[kj] = kj % 2 ? shift(o0, o1, kj / 2) : shift(e0, e1, kj / 2);
  }
};

// acc[r][v] += the taps of output row r (input rows r SH .. r SH + K - 1 of the block) from input rows J,
// J + 1, ... (`row` floats apart from `top`, the block's first input row at its first output's input), the
// K x K weight k.
template <class Src, int K, int SH, int R, int V, int J = 0>
MLXD_AVX512 [[gnu::always_inline]] inline void accumulate(const float* top, int64_t row, int64_t half, const float* k,
                                                         __m512 (&acc)[R][V]) {
  if constexpr (J < (R - 1) * SH + K) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      __m512 x[K];
      Src::template windows<K>(top + J * row + Src::kStep * v, half, x);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int ki = J - r * SH;
        if (ki < 0 || ki >= K) continue;
#pragma GCC unroll 8
        for (int kj = 0; kj < K; ++kj) acc[r][v] = fma_bcast(k + ki * K + kj, x[kj], acc[r][v]);
      }
    }
    accumulate<Src, K, SH, R, V, J + 1>(top, row, half, k, acc);
  }
}

}  // namespace mlxd::rt::dw_rows
#endif
