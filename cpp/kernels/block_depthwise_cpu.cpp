// Depthwise rows of the inverted-residual block (block_cpu.cpp) from zero-bordered planes: the
// AVX2 / AVX-512 register blocks, the scalar rows, and the planes' fill.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/block_cpu_internal.h"
#include "kernels/cpu_parallel.h"
#include "kernels/depthwise_rows_avx512.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt::block_detail {
namespace {

// One depthwise output row: out[ow] = act(bias + sum_t k[t] * rows[ki][ow * S + kj]).
void dw_row_scalar(const Geometry& g, const float* const* rows, const float* k, float bias, float* out) {
  for (int ow = 0; ow < g.OW; ++ow) {
    float acc = bias;
    for (int ki = 0; ki < g.KH; ++ki)
      for (int kj = 0; kj < g.KW; ++kj) acc += k[ki * g.KW + kj] * rows[ki][int64_t{ow} * g.sw + kj];
    out[ow] = activate(g.da, acc);
  }
}

#ifdef MLXD_CPU_X86
// max(lo, a) / min(hi, a) keep a NaN (the second operand), as std::max(a, lo) does.
MLXD_AVX2 inline __m256 clamp8(__m256 a, __m256 lo, __m256 hi) { return _mm256_min_ps(hi, _mm256_max_ps(lo, a)); }

// Lanes [0, n) of eight on (n < 8).
MLXD_AVX2 inline __m256i tail_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// dst[i] = act(src[i] + b) for a clamp activation.
MLXD_AVX2 void act_row_avx2(const float* src, float b, const BlockActivation& a, int n, float* dst) {
  const __m256 vb = _mm256_set1_ps(b), lo = _mm256_set1_ps(a.lo), hi = _mm256_set1_ps(a.hi);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, clamp8(_mm256_add_ps(_mm256_loadu_ps(src + i), vb), lo, hi));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(dst + i, m, clamp8(_mm256_add_ps(_mm256_maskload_ps(src + i, m), vb), lo, hi));
  }
}

// R output rows from row i of the tile by V vectors of eight columns from ow: R x V accumulators
// in registers (independent FMA chains, each weight broadcast once per block), clamped as stored
// (the caller maps the rest of the activation over whole channels); the last vector stored
// under `tail`, rows from `rows` on computed from the buffer's slack rows but not stored.
// KH_ / KW_: the window when known at compile time (3x3, 5x5: the taps unrolled), else 0 (the
// geometry's).
template <int S, int KH_, int KW_, int R, int V>
MLXD_AVX2 void dw_block_avx2(const Geometry& g, const float* buf, int64_t Wp, const __m256* wv, __m256 vb, int i,
                             int ow, int rows, __m256i tail, float* out) {
  const int kh = KH_ ? KH_ : g.KH, kw = KW_ ? KW_ : g.KW;
  const __m256 lo = _mm256_set1_ps(g.da.lo), hi = _mm256_set1_ps(g.da.hi);
  const int64_t step = int64_t{g.sh} * Wp;
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vb;
  const float* top = buf + int64_t{i} * step + int64_t{ow} * S;
  for (int ki = 0; ki < kh; ++ki)
    for (int kj = 0; kj < kw; ++kj) {
      const __m256 w = wv[ki * kw + kj];
      const float* p = top + ki * Wp + kj;
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v)
          acc[r][v] = _mm256_fmadd_ps(w, vmath::load_strided<S>(p + r * step + 8 * v * S), acc[r][v]);
    }
  for (int r = 0; r < R && r < rows; ++r) {
    float* o = out + int64_t{i + r} * g.OW + ow;
    for (int v = 0; v < V - 1; ++v) _mm256_storeu_ps(o + 8 * v, clamp8(acc[r][v], lo, hi));
    _mm256_maskstore_ps(o + 8 * (V - 1), tail, clamp8(acc[r][V - 1], lo, hi));
  }
}

// The depthwise rows of one channel for output rows [0, count) of the tile, in blocks of R rows by
// up to four vectors (narrow maps: eight rows of one vector or four of two, so 7- and 14-column maps
// still run eight independent accumulators).
template <int S, int KH_, int KW_, int R>
MLXD_AVX2 void dw_channel_avx2(const Geometry& g, const float* buf, int64_t Wp, const float* k, float bias, int count,
                               float* out) {
  __m256 wv[kMaxTaps];
  for (int t = 0; t < g.KH * g.KW; ++t) wv[t] = _mm256_set1_ps(k[t]);
  const __m256 vb = _mm256_set1_ps(bias);
  for (int i = 0; i < count; i += R) {
    const int rows = std::min(R, count - i);
    for (int ow = 0; ow < g.OW; ow += 32) {
      const int left = g.OW - ow, V = std::min(4, (left + 7) / 8);
      const __m256i tail = tail_mask(left - 8 * (V - 1));  // eight: every lane
      switch (V) {
        case 1: dw_block_avx2<S, KH_, KW_, R, 1>(g, buf, Wp, wv, vb, i, ow, rows, tail, out); break;
        case 2: dw_block_avx2<S, KH_, KW_, R, 2>(g, buf, Wp, wv, vb, i, ow, rows, tail, out); break;
        case 3: dw_block_avx2<S, KH_, KW_, R, 3>(g, buf, Wp, wv, vb, i, ow, rows, tail, out); break;
        default: dw_block_avx2<S, KH_, KW_, R, 4>(g, buf, Wp, wv, vb, i, ow, rows, tail, out); break;
      }
    }
  }
}

constexpr int kDw16Rows = 4;  // sixteen-lane blocks: up to 4 x 4 accumulators

// Sixteen outputs at width stride S from p: S = 2 reads p[0..31] and keeps the even ones.
template <int S>
MLXD_AVX512 inline __m512 load16(const float* p) {
  if constexpr (S == 1) {
    return _mm512_loadu_ps(p);
  } else {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_permutex2var_ps(_mm512_loadu_ps(p), even, _mm512_loadu_ps(p + 16));
  }
}

// The same on sixteen lanes (AVX-512F): kDw16Rows rows by V vectors of sixteen columns from `top`
// (the block's first padded row, at its first column), the last vector stored under `tail`. Reads stay
// inside the padded rows (padded_width rounds the columns up to sixteen) and the slack rows.
template <int S, int KH_, int KW_, int V>
MLXD_AVX512 void dw_block16(const Geometry& g, const float* top, int64_t Wp, const float* k, float bias, int rows,
                            __mmask16 tail, float* out) {
  constexpr int R = kDw16Rows;
  const int kh = KH_ ? KH_ : g.KH, kw = KW_ ? KW_ : g.KW;
  const int64_t step = int64_t{g.sh} * Wp;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_set1_ps(bias);
  for (int ki = 0; ki < kh; ++ki)
    for (int kj = 0; kj < kw; ++kj) {
      const __m512 w = _mm512_set1_ps(k[ki * kw + kj]);
      const float* p = top + ki * Wp + kj;
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w, load16<S>(p + r * step + 16 * v * S), acc[r][v]);
    }
  const __m512 lo = _mm512_set1_ps(g.da.lo), hi = _mm512_set1_ps(g.da.hi);
  for (int r = 0; r < R && r < rows; ++r)
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(out + int64_t{r} * g.OW + 16 * v, v == V - 1 ? tail : __mmask16(0xFFFF),
                            _mm512_min_ps(hi, _mm512_max_ps(lo, acc[r][v])));
}

// A channel's rows in blocks of kDw16Rows rows by up to four vectors of sixteen columns: maps wider
// than eight columns, where eight-lane blocks run twice the instructions for the same outputs.
template <int S, int KH_, int KW_>
MLXD_AVX512 void dw_channel16(const Geometry& g, const float* buf, int64_t Wp, const float* k, float bias, int count,
                              float* out) {
  const int64_t step = int64_t{g.sh} * Wp;
  for (int i = 0; i < count; i += kDw16Rows) {
    const int rows = std::min(kDw16Rows, count - i);
    for (int ow = 0; ow < g.OW; ow += 64) {
      const int left = g.OW - ow, V = std::min(4, (left + 15) / 16);
      const __mmask16 tail = vmath::first_lanes(left - 16 * (V - 1));
      const float* top = buf + i * step + int64_t{ow} * S;
      float* o = out + int64_t{i} * g.OW + ow;
      switch (V) {
        case 1: dw_block16<S, KH_, KW_, 1>(g, top, Wp, k, bias, rows, tail, o); break;
        case 2: dw_block16<S, KH_, KW_, 2>(g, top, Wp, k, bias, rows, tail, o); break;
        case 3: dw_block16<S, KH_, KW_, 3>(g, top, Wp, k, bias, rows, tail, o); break;
        default: dw_block16<S, KH_, KW_, 4>(g, top, Wp, k, bias, rows, tail, o); break;
      }
    }
  }
}

// Rows read once per block (depthwise_rows_avx512.h): 3x3, 5x5 and 7x7 windows at equal strides of 1 or 2.
template <int S, int K, int V>
MLXD_AVX512 void dw_rows_block16(const Geometry& g, const float* top, int64_t Wp, const float* k, float bias,
                                 int rows, __mmask16 tail, float* out) {
  constexpr int R = kDw16Rows;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_set1_ps(bias);
  using Src = std::conditional_t<S == 1, dw_rows::Contiguous, dw_rows::Interleaved2>;
  dw_rows::accumulate<Src, K, S, R, V>(top, Wp, 0, k, acc);
  const __m512 lo = _mm512_set1_ps(g.da.lo), hi = _mm512_set1_ps(g.da.hi);
  for (int r = 0; r < R && r < rows; ++r)
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(out + int64_t{r} * g.OW + 16 * v, v == V - 1 ? tail : __mmask16(0xFFFF),
                            _mm512_min_ps(hi, _mm512_max_ps(lo, acc[r][v])));
}

// A channel in blocks of kDw16Rows rows by up to two vectors (four measured no faster, and spill at 5x5).
template <int S, int K>
MLXD_AVX512 void dw_channel16_rows(const Geometry& g, const float* buf, int64_t Wp, const float* k, float bias,
                                   int count, float* out) {
  for (int i = 0; i < count; i += kDw16Rows) {
    const int rows = std::min(kDw16Rows, count - i);
    for (int ow = 0; ow < g.OW; ow += 32) {
      const int left = g.OW - ow;
      const float* top = buf + int64_t{i} * S * Wp + int64_t{ow} * S;
      float* o = out + int64_t{i} * g.OW + ow;
      if (left > 16)
        dw_rows_block16<S, K, 2>(g, top, Wp, k, bias, rows, vmath::first_lanes(left - 16), o);
      else
        dw_rows_block16<S, K, 1>(g, top, Wp, k, bias, rows, vmath::first_lanes(left), o);
    }
  }
}

// The instance for the width stride (1 or 2) and window (3x3, 5x5 or any).
template <int S, int R>
DwChannelFn dw_channel_rows(const Geometry& g) {
  if (g.KH == 3 && g.KW == 3) return dw_channel_avx2<S, 3, 3, R>;
  if (g.KH == 5 && g.KW == 5) return dw_channel_avx2<S, 5, 5, R>;
  return dw_channel_avx2<S, 0, 0, R>;
}
// Eight rows of one vector up to eight columns (7x7 maps: one block, eight independent accumulators);
// sixteen lanes beyond where AVX-512 runs (rows read once for square 3-7 windows at equal strides); else
// four rows per block up to two vectors of eight wide,
// two rows beyond (at most eight accumulators).
template <int S>
DwChannelFn dw_channel_for(const Geometry& g) {
  if (g.OW <= 8) return dw_channel_rows<S, 8>(g);
  if (cpu_use_avx512()) {
    if (g.sh == S && g.KH == g.KW && (g.KH == 3 || g.KH == 5 || g.KH == 7))
      return g.KH == 3 ? dw_channel16_rows<S, 3> : g.KH == 5 ? dw_channel16_rows<S, 5> : dw_channel16_rows<S, 7>;
    if (g.KH == 3 && g.KW == 3) return dw_channel16<S, 3, 3>;
    if (g.KH == 5 && g.KW == 5) return dw_channel16<S, 5, 5>;
    return dw_channel16<S, 0, 0>;
  }
  return g.OW <= 16 ? dw_channel_rows<S, 4>(g) : dw_channel_rows<S, 2>(g);
}
#endif

void dw_channel_scalar(const Geometry& g, const float* buf, int64_t Wp, const float* k, float bias, int count,
                       float* out) {
  const float* rows[7];
  for (int i = 0; i < count; ++i) {
    for (int ki = 0; ki < g.KH; ++ki) rows[ki] = buf + (int64_t{i} * g.sh + ki) * Wp;
    dw_row_scalar(g, rows, k, bias, out + int64_t{i} * g.OW);
  }
}

#ifdef MLXD_CPU_X86
template <bool Act>
MLXD_AVX2 inline __m256 fill_value(__m256 v, __m256 b, __m256 lo, __m256 hi) {
  return Act ? clamp8(_mm256_add_ps(v, b), lo, hi) : v;
}

template <bool Act>
MLXD_AVX2 void fill_plane_avx2(const float* src, int rows, int W, float b, const BlockActivation& a, float* dst,
                               int64_t Wp, int pw, bool borders) {
  const __m256 vb = _mm256_set1_ps(b), lo = _mm256_set1_ps(a.lo), hi = _mm256_set1_ps(a.hi);
  const int full = W / 8 * 8;
  const __m256i tail = tail_mask(W - full);
  for (int r = 0; r < rows; ++r, src += W, dst += Wp) {
    if (borders) {
      std::fill_n(dst, pw, 0.f);
      std::fill(dst + pw + W, dst + Wp, 0.f);
    }
    float* row = dst + pw;
    int i = 0;
    for (; i < full; i += 8) _mm256_storeu_ps(row + i, fill_value<Act>(_mm256_loadu_ps(src + i), vb, lo, hi));
    if (i < W) _mm256_maskstore_ps(row + i, tail, fill_value<Act>(_mm256_maskload_ps(src + i, tail), vb, lo, hi));
  }
}
#endif

}  // namespace

int padded_width(const Geometry& g) {
  const int ow_v = (g.OW + 15) / 16 * 16;  // whole vectors of sixteen (or eight) outputs
  return std::max(g.pw + g.W, (ow_v - 1) * g.sw + g.KW + g.sw - 1) + 1;
}

DwChannelFn dw_channel_fn(const Geometry& g) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2() && (g.sw == 1 || g.sw == 2)) return g.sw == 1 ? dw_channel_for<1>(g) : dw_channel_for<2>(g);
#endif
  return dw_channel_scalar;
}

void act_row(const float* src, float b, const BlockActivation& a, int n, float* dst) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2()) return act_row_avx2(src, b, a, n, dst);
#endif
  for (int i = 0; i < n; ++i) dst[i] = activate(a, src[i] + b);
}

void fill_plane(const float* src, int rows, int W, bool act, float b, const BlockActivation& a, float* dst,
                int64_t Wp, int pw, bool borders) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2()) {
    (act ? fill_plane_avx2<true> : fill_plane_avx2<false>)(src, rows, W, b, a, dst, Wp, pw, borders);
    return;
  }
#endif
  for (int r = 0; r < rows; ++r, src += W, dst += Wp) {
    if (borders) {
      std::fill_n(dst, pw, 0.f);
      std::fill(dst + pw + W, dst + Wp, 0.f);
    }
    for (int i = 0; i < W; ++i) dst[pw + i] = act ? activate(a, src[i] + b) : src[i];
  }
}

}  // namespace mlxd::rt::block_detail
