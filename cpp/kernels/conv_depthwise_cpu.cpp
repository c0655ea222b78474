// Depthwise convolutions on the CPU (conv_cpu.h): one input channel per group, a direct loop per
// output plane (AVX2 / AVX-512 rows over a zero-bordered copy of each plane for width strides 1 and 2).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/conv_cpu.h"
#include "kernels/conv_cpu_internal.h"
#include "kernels/cpu_parallel.h"
#include "kernels/depthwise_rows_avx512.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt::conv_detail {
namespace {

// One output plane of a depthwise convolution, row by row and tap by tap
// (the compiler vectorises the stride-1 row loops): any stride and dilation.
void depthwise_plane(const Geometry& g, const float* plane, const float* k, float* out) {
  for (int kj = 0; kj < g.KW; ++kj) {
    const auto [lo, hi] = valid_range(g.OW, g.W, g.sw, g.pw, kj * g.dw);
    if (lo >= hi) continue;
    for (int oh = 0; oh < g.OH; ++oh) {
      float* orow = out + int64_t{oh} * g.OW;
      for (int ki = 0; ki < g.KH; ++ki) {
        const int ih = oh * g.sh - g.ph + ki * g.dh;
        if (ih < 0 || ih >= g.H) continue;
        const float wv = k[ki * g.KW + kj];
        const float* row = plane + int64_t{ih} * g.W - g.pw + kj * g.dw;
        if (g.sw == 1) {
          for (int ow = lo; ow < hi; ++ow) orow[ow] += wv * row[ow];
        } else {
          for (int ow = lo; ow < hi; ++ow) orow[ow] += wv * row[int64_t{ow} * g.sw];
        }
      }
    }
  }
  finish(g, out, g.P());
}

#ifdef MLXD_CPU_X86
// Output rows a depthwise block covers at most (kDwRows) and vectors of eight columns (kDwVectors):
// up to 8 accumulators in registers, each weight broadcast once per block.
constexpr int kDwRows = 4, kDwVectors = 4;

// A depthwise convolution's input plane inside a zero border wide enough for
// every tap of every value computed: blocks of whole vectors and rows (output
// columns up to OW rounded up to 8, rows up to a block past OH), whose extra
// lanes and rows read on into the next row or the zeroed slack and are never
// stored. So the loops below have no edge cases, whatever the padding, kernel
// size (3x3, 5x5, ...) or map width. At width stride 2 each padded row is
// stored as its even columns, then its odd ones: output column ow's tap at
// padded column 2 ow + j is then element ow + j / 2 of one half, and every
// load is eight consecutive floats instead of sixteen shuffled to eight.
struct PaddedPlane {
  int Wp, Hp;        // padded row length and rows
  int half;          // stride 2: the length of each half of a stored row (0: stored as is)
  int64_t row;       // floats per stored row
  int64_t size;      // floats, slack included
  std::vector<int64_t> taps;  // each tap's offset from its output's first input (ki * dh rows, kj * dw columns)
  PaddedPlane(const Geometry& g, int S) {
    Wp = std::max(g.pw + g.W, (g.OW - 1) * S + (g.KW - 1) * g.dw + 1);
    Hp = std::max(g.ph + g.H, (g.OH - 1) * g.sh + (g.KH - 1) * g.dh + 1);
    half = S == 2 ? (Wp + 1) / 2 : 0;
    row = S == 2 ? 2 * int64_t{half} : Wp;
    size = (Hp + int64_t{kDwRows} * g.sh + 1) * row + int64_t{g.OW + 16} * S + int64_t{g.KW} * g.dw + 32;
    for (int ki = 0; ki < g.KH; ++ki)
      for (int kj = 0; kj < g.KW; ++kj) {
        const int c = kj * g.dw;
        taps.push_back(int64_t{ki} * g.dh * row + (S == 2 ? (c & 1) * int64_t{half} + (c >> 1) : c));
      }
  }
  // Where padded column c of a stored row lives.
  int64_t at(int c) const { return half ? (c & 1) * int64_t{half} + (c >> 1) : c; }
};

// max(lo, a) / min(hi, a) keep a NaN (the second operand), as std::max(a, lo) does.
MLXD_AVX2 inline __m256 clamp8(__m256 a, __m256 lo, __m256 hi) { return _mm256_min_ps(hi, _mm256_max_ps(lo, a)); }

struct DwRow {  // what a block needs besides its position
  const float* buf;
  const float* k;
  const float* residual;  // the plane's, or null
  float* out;
  __m256 bias, lo, hi;
  __m256i tail;  // lanes of the block's last vector inside the row
};

// R output rows from oh (`rows` of them stored) by V vectors of eight columns
// from ow: the taps accumulated in registers from the bias (and the
// residual), clamped as they are stored; the last vector masked by `tail`.
template <int R, int V>
MLXD_AVX2 void depthwise_block(const Geometry& g, const PaddedPlane& pp, const DwRow& d, int oh, int ow, int rows) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      acc[r][v] = d.bias;
      if (d.residual && r < rows) {
        const float* res = d.residual + int64_t{oh + r} * g.OW + ow + 8 * v;
        acc[r][v] = _mm256_add_ps(acc[r][v], v == V - 1 ? _mm256_maskload_ps(res, d.tail) : _mm256_loadu_ps(res));
      }
    }
  const int64_t row_step = int64_t{g.sh} * pp.row;
  // Output column ow's first input: padded column ow (stride 1) or 2 ow (stride 2, element ow of the even half).
  const float* top = d.buf + int64_t{oh} * row_step + ow;
  const int taps = g.KH * g.KW;
  for (int t = 0; t < taps; ++t) {
    const __m256 w = _mm256_broadcast_ss(d.k + t);
    const float* p = top + pp.taps[t];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(p + r * row_step + 8 * v), acc[r][v]);
  }
  for (int r = 0; r < R && r < rows; ++r)
    for (int v = 0; v < V; ++v) {
      float* o = d.out + int64_t{oh + r} * g.OW + ow + 8 * v;
      const __m256 y = clamp8(acc[r][v], d.lo, d.hi);
      if (v == V - 1)
        _mm256_maskstore_ps(o, d.tail, y);
      else
        _mm256_storeu_ps(o, y);
    }
}

// A sixteen-lane block's accumulators: the bias (and the residual's rows from oh, columns from ow), the
// last vector under `tail`.
template <int R, int V>
MLXD_AVX512 [[gnu::always_inline]] inline void start16(const Geometry& g, const DwRow& d, int oh, int ow, int rows,
                                                      __mmask16 tail, __m512 (&acc)[R][V]) {
  const __m512 bias = _mm512_set1_ps(_mm256_cvtss_f32(d.bias));
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      acc[r][v] = bias;
      if (d.residual && r < rows) {
        const float* res = d.residual + int64_t{oh + r} * g.OW + ow + 16 * v;
        acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_maskz_loadu_ps(v == V - 1 ? tail : __mmask16(0xFFFF), res));
      }
    }
}

// ... and its first `rows` rows clamped into the output.
template <int R, int V>
MLXD_AVX512 [[gnu::always_inline]] inline void store16(const Geometry& g, const DwRow& d, int oh, int ow, int rows,
                                                      __mmask16 tail, const __m512 (&acc)[R][V]) {
  const __m512 lo = _mm512_set1_ps(_mm256_cvtss_f32(d.lo)), hi = _mm512_set1_ps(_mm256_cvtss_f32(d.hi));
  for (int r = 0; r < R && r < rows; ++r)
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(d.out + int64_t{oh + r} * g.OW + ow + 16 * v, v == V - 1 ? tail : __mmask16(0xFFFF),
                            _mm512_min_ps(hi, _mm512_max_ps(lo, acc[r][v])));
}

// depthwise_block on sixteen lanes (AVX-512F), for maps wide enough to fill them.
template <int R, int V>
MLXD_AVX512 void depthwise_block16(const Geometry& g, const PaddedPlane& pp, const DwRow& d, int oh, int ow, int rows,
                                   __mmask16 tail) {
  __m512 acc[R][V];
  start16(g, d, oh, ow, rows, tail, acc);
  const int64_t row_step = int64_t{g.sh} * pp.row;
  const float* top = d.buf + int64_t{oh} * row_step + ow;
  const int taps = g.KH * g.KW;
  for (int t = 0; t < taps; ++t) {
    const __m512 w = _mm512_set1_ps(d.k[t]);
    const float* p = top + pp.taps[t];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(p + r * row_step + 16 * v), acc[r][v]);
  }
  store16(g, d, oh, ow, rows, tail, acc);
}

// Rows of 2 output rows by up to 4 vectors of sixteen columns.
MLXD_AVX512 void depthwise_rows16(const Geometry& g, const PaddedPlane& pp, const DwRow& d) {
  constexpr int R = 2;
  for (int oh = 0; oh < g.OH; oh += R) {
    const int rows = std::min(R, g.OH - oh);
    for (int ow = 0; ow < g.OW; ow += 16 * kDwVectors) {
      const int left = g.OW - ow, V = std::min(kDwVectors, (left + 15) / 16);
      const int last = left - 16 * (V - 1);
      const __mmask16 tail = static_cast<__mmask16>(last >= 16 ? 0xFFFF : (1u << last) - 1u);
      switch (V) {
        case 1: depthwise_block16<R, 1>(g, pp, d, oh, ow, rows, tail); break;
        case 2: depthwise_block16<R, 2>(g, pp, d, oh, ow, rows, tail); break;
        case 3: depthwise_block16<R, 3>(g, pp, d, oh, ow, rows, tail); break;
        default: depthwise_block16<R, 4>(g, pp, d, oh, ow, rows, tail); break;
      }
    }
  }
}

// Rows read once per block (depthwise_rows_avx512.h): kDwRows output rows by V vectors of sixteen from oh, ow,
// the first input of output column ow at padded column ow (stride 1) or element ow of the even half (stride 2).
template <class Src, int K, int S, int V>
MLXD_AVX512 void depthwise_once_block(const Geometry& g, const PaddedPlane& pp, const DwRow& d, int oh, int ow,
                                      int rows, __mmask16 tail) {
  constexpr int R = kDwRows;
  __m512 acc[R][V];
  start16(g, d, oh, ow, rows, tail, acc);
  dw_rows::accumulate<Src, K, S, R, V>(d.buf + int64_t{oh} * S * pp.row + ow, pp.row, pp.half, d.k, acc);
  store16(g, d, oh, ow, rows, tail, acc);
}

template <class Src, int K, int S>
MLXD_AVX512 void depthwise_rows_once(const Geometry& g, const PaddedPlane& pp, const DwRow& d) {
  for (int oh = 0; oh < g.OH; oh += kDwRows) {
    const int rows = std::min(kDwRows, g.OH - oh);
    for (int ow = 0; ow < g.OW; ow += 32) {
      const int left = g.OW - ow;
      if (left > 16)
        depthwise_once_block<Src, K, S, 2>(g, pp, d, oh, ow, rows, vmath::first_lanes(left - 16));
      else
        depthwise_once_block<Src, K, S, 1>(g, pp, d, oh, ow, rows, vmath::first_lanes(left));
    }
  }
}

using RowsFn = void (*)(const Geometry&, const PaddedPlane&, const DwRow&);

// The rows-once instance for g: square 3x3, 5x5 or 7x7 windows, no dilation, equal strides of 1 or 2; else null.
RowsFn rows_once_fn(const Geometry& g) {
  if (!cpu_use_avx512() || g.dh != 1 || g.dw != 1 || g.sh != g.sw || g.KH != g.KW) return nullptr;
  using C = dw_rows::Contiguous;
  using H = dw_rows::SplitHalves2;
  switch (g.KH * 10 + g.sw) {
    case 31: return depthwise_rows_once<C, 3, 1>;
    case 32: return depthwise_rows_once<H, 3, 2>;
    case 51: return depthwise_rows_once<C, 5, 1>;
    case 52: return depthwise_rows_once<H, 5, 2>;
    case 71: return depthwise_rows_once<C, 7, 1>;
    case 72: return depthwise_rows_once<H, 7, 2>;
    default: return nullptr;
  }
}

// Rows of R output rows, each cut into blocks of up to kDwVectors vectors.
template <int R>
MLXD_AVX2 void depthwise_rows(const Geometry& g, const PaddedPlane& pp, DwRow& d) {
  for (int oh = 0; oh < g.OH; oh += R) {
    const int rows = std::min(R, g.OH - oh);
    for (int ow = 0; ow < g.OW; ow += 8 * kDwVectors) {
      const int left = g.OW - ow, V = std::min(kDwVectors, (left + 7) / 8);
      d.tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(left - 8 * (V - 1)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      switch (V) {
        case 1: depthwise_block<R, 1>(g, pp, d, oh, ow, rows); break;
        case 2: depthwise_block<R, 2>(g, pp, d, oh, ow, rows); break;
        case 3: depthwise_block<R, 3>(g, pp, d, oh, ow, rows); break;
        default: depthwise_block<R, 4>(g, pp, d, oh, ow, rows); break;
      }
    }
  }
}

// The input row `src` (W floats) into stored row `dst` at padded column pw.
MLXD_AVX2 void store_padded_row(const Geometry& g, const PaddedPlane& pp, const float* src, float* dst) {
  if (!pp.half) {
    std::memcpy(dst + g.pw, src, g.W * sizeof(float));
    return;
  }
  // Stride 2: input column iw lands at padded column iw + pw, in the even or the odd half.
  float* first = dst + pp.at(g.pw);       // where src[0], src[2], ... go, consecutively
  float* second = dst + pp.at(g.pw + 1);  // src[1], src[3], ...
  int iw = 0;
  for (; iw + 16 <= g.W; iw += 16) {
    const __m256 a = _mm256_loadu_ps(src + iw), b = _mm256_loadu_ps(src + iw + 8);
    const __m256 even = _mm256_shuffle_ps(a, b, 0x88), odd = _mm256_shuffle_ps(a, b, 0xDD);  // lanes a0 a2 b0 b2 | ...
    _mm256_storeu_ps(first + iw / 2, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
    _mm256_storeu_ps(second + iw / 2, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
  }
  for (; iw < g.W; ++iw) (iw & 1 ? second : first)[iw / 2] = src[iw];
}

// One output plane of a depthwise convolution (any height stride, dilation
// and padding; width stride 1 or 2) from its padded copy `buf` (the interior
// is written here unless `plane` is null; the border and slack stay zero):
// blocks of output rows and columns in registers (more rows per block on
// narrow maps, so each weight is broadcast once for up to eight vectors), then
// the activation on the finished plane while it is in cache.
MLXD_AVX2 void depthwise_padded(const Geometry& g, const PaddedPlane& pp, float* buf, const float* plane,
                                const float* k, float bias, const float* residual, float* out) {
  if (plane != nullptr)
    for (int ih = 0; ih < g.H; ++ih) store_padded_row(g, pp, plane + int64_t{ih} * g.W, buf + (ih + g.ph) * pp.row);
  DwRow d{buf, k, residual, out, _mm256_set1_ps(bias), _mm256_set1_ps(g.clamp ? g.lo : -INFINITY),
          _mm256_set1_ps(g.clamp ? g.hi : INFINITY), _mm256_setzero_si256()};
  const RowsFn once = g.OW >= 28 ? rows_once_fn(g) : nullptr;
  if (once)
    once(g, pp, d);
  else if (g.OW >= 28 && cpu_use_avx512())
    depthwise_rows16(g, pp, d);  // sixteen lanes: at most 4 of 32 columns of a vector pair wasted
  else if (g.OW > 16)
    depthwise_rows<2>(g, pp, d);  // 2 rows x up to 4 vectors
  else
    depthwise_rows<kDwRows>(g, pp, d);  // 4 rows x 1-2 vectors
  activate(g, out, g.P());
}
#endif

}  // namespace

void depthwise(const Geometry& g, const float* x, const float* w, int64_t w_image, const float* bias,
               const float* residual, float* y) {
  const int m = g.Og();  // output channels per input channel
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2() && (g.sw == 1 || g.sw == 2) && conv_tiles()) {
    cpu_kernel_note_call("conv_depthwise_padded");
    const PaddedPlane pp(g, g.sw);
    cpu_parallel_for(int64_t{g.N} * g.O, g.P() * g.KH * g.KW, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(pp.size, 0.f);  // the border and slack stay zero across planes
      const float* last = nullptr;
      for (int64_t p = begin; p < end; ++p) {
        const int o = static_cast<int>(p % g.O);
        const float* plane = x + (p / g.O * g.C + o / m) * int64_t{g.H} * g.W;
        const float* k = w + p / g.O * w_image + int64_t{o} * g.KH * g.KW;
        // A channel multiplier's outputs read one input plane: copied once.
        depthwise_padded(g, pp, buf.data(), plane == last ? nullptr : plane, k, bias ? bias[o] : 0.f,
                         residual ? residual + p * g.P() : nullptr, y + p * g.P());
        last = plane;
      }
    });
    return;
  }
#endif
  cpu_parallel_for(int64_t{g.N} * g.O, g.P() * g.KH * g.KW, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int o = static_cast<int>(p % g.O);
      const float* plane = x + (p / g.O * g.C + o / m) * int64_t{g.H} * g.W;
      const float* k = w + p / g.O * w_image + int64_t{o} * g.KH * g.KW;
      float* out = y + p * g.P();
      init_plane(g, out, bias ? bias[o] : 0.f, residual ? residual + p * g.P() : nullptr);
      depthwise_plane(g, plane, k, out);
    }
  });
}

}  // namespace mlxd::rt::conv_detail
