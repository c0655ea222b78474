// Convolution on the CPU (see conv_cpu.h): im2col + sgemm per image and
// group (large products in tiles of output rows, smaller ones in blocks of
// output channels, each tile or block one task on one thread), or a direct loop
// for depthwise (one input channel per group; AVX2 rows over a zero-bordered
// copy of each plane for width strides 1 and 2).
#include "kernels/conv_cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/unary_cpu.h"
#include "kernels/vec_math_cpu.h"
#include "kernels/winograd_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

// cblas_sgemm as the process resolves it: the BLAS front (cpp/blas_shim.cpp)
// when mlx_delegate installed it, else whichever BLAS is globally visible.
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
SgemmFn sgemm() {
  static const SgemmFn f = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return f;
}
constexpr int kRowMajor = 101, kNoTrans = 111;

struct Tensor {
  const void* data;
  mx::Dtype dtype;
  mx::Shape shape;
  mx::Strides strides;
  bool contiguous;
};

Tensor tensor(const mx::array& a) {
  return {a.data<void>(), a.dtype(), a.shape(), a.strides(), a.flags().row_contiguous};
}

// A's elements as row-major float32: in place when it already is, else
// converted into `store`.
const float* as_f32(const Tensor& t, std::vector<float>& store) {
  if (t.dtype == mx::float32 && t.contiguous) return static_cast<const float*>(t.data);
  CpuRowMajor packed(t.data, mx::size_of(t.dtype), t.shape, t.strides, t.contiguous);
  int64_t n = 1;
  for (int d : t.shape) n *= d;
  store.resize(n);
  cpu_load_f32(packed.data(), t.dtype, 0, n, store.data());
  return store.data();
}

struct Geometry {
  int N, C, H, W, O, KH, KW, OH, OW, sh, sw, ph, pw, dh, dw, groups;
  int act;  // the UnaryKernel applied after the clamp, -1: none
  bool clamp;
  float lo, hi;
  int Cg() const { return C / groups; }
  int Og() const { return O / groups; }
  int64_t P() const { return int64_t{OH} * OW; }
};

// The output columns ow whose input column ow * s - p + k lies in [0, in): [lo, hi).
std::pair<int, int> valid_range(int out, int in, int s, int p, int k) {
  // ow * s >= p - k  and  ow * s <= in - 1 + p - k
  int lo_num = p - k, hi_num = in - 1 + p - k;
  int lo = lo_num <= 0 ? 0 : (lo_num + s - 1) / s;
  int hi = hi_num < 0 ? 0 : hi_num / s + 1;
  return {std::min(lo, out), std::clamp(hi, std::min(lo, out), out)};
}

#ifdef MLXD_CPU_X86
// out[ow] = row[2 * ow] for ow in [lo, hi) eight at a time while a vector's
// 16-float read stays below `limit` (the row's end in the plane); returns the
// first ow left to the scalar loop.
MLXD_AVX2 int gather_stride2(const float* row, float* out, int lo, int hi, int64_t limit) {
  int ow = lo;
  for (; ow + 8 <= hi && 2 * int64_t{ow} + 16 <= limit; ow += 8)
    _mm256_storeu_ps(out + ow, vmath::load_strided<2>(row + 2 * int64_t{ow}));
  return ow;
}
#endif

// One im2col row (input channel plane `plane`, tap ki, kj) for output rows
// [oh0, oh1): (oh1 - oh0) * OW values into `out`, zeros where the window reads padding.
void im2col_row(const Geometry& g, const float* plane, int ki, int kj, int oh0, int oh1, float* out) {
  const auto [lo, hi] = valid_range(g.OW, g.W, g.sw, g.pw, kj * g.dw);
  for (int oh = oh0; oh < oh1; ++oh, out += g.OW) {
    const int ih = oh * g.sh - g.ph + ki * g.dh;
    if (ih < 0 || ih >= g.H || lo >= hi) {
      std::fill(out, out + g.OW, 0.f);
      continue;
    }
    std::fill(out, out + lo, 0.f);
    std::fill(out + hi, out + g.OW, 0.f);
    const float* row = plane + int64_t{ih} * g.W - g.pw + kj * g.dw;
    if (g.sw == 1) {
      std::memcpy(out + lo, row + lo, (hi - lo) * sizeof(float));
    } else {
      int ow = lo;
#ifdef MLXD_CPU_X86
      // Stride 2 (strided stems and downsampling convolutions): reads end within this input row.
      if (g.sw == 2 && cpu_use_avx2()) ow = gather_stride2(row, out, lo, hi, int64_t{g.W} + g.pw - kj * g.dw);
#endif
      for (; ow < hi; ++ow) out[ow] = row[int64_t{ow} * g.sw];
    }
  }
}

// cols [Cg * KH * KW, count * OH * OW] (row stride ld) for images first ..
// first + count - 1 and group gi: image i fills columns [i * OH * OW, (i + 1) * OH * OW).
void im2col(const Geometry& g, const float* x, int first, int count, int gi, float* cols, int64_t ld) {
  const int64_t rows = int64_t{g.Cg()} * g.KH * g.KW;
  cpu_parallel_for(rows * count, g.P(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t image = t / rows, r = t % rows;
      const int c = static_cast<int>(r / (g.KH * g.KW)), ki = static_cast<int>(r / g.KW % g.KH),
                kj = static_cast<int>(r % g.KW);
      const float* plane = x + ((first + image) * g.C + int64_t{gi} * g.Cg() + c) * g.H * g.W;
      im2col_row(g, plane, ki, kj, 0, g.OH, cols + r * ld + image * g.P());
    }
  });
}

// Images of fewer output columns than this share one sgemm (their im2col
// columns side by side): a product 49 columns wide (a 7x7 map) runs far below
// the BLAS's peak, and each call has a fixed cost.
// MLX_DELEGATE_CONV_BATCH=0 keeps one sgemm per image (A/B measurements).
int64_t batch_columns() {
  static const int64_t v = [] {
    const char* e = std::getenv("MLX_DELEGATE_CONV_BATCH");
    return e && std::string(e) == "0" ? int64_t{0} : int64_t{1024};
  }();
  return v;
}

void clamp_range(const Geometry& g, float* y, int64_t n) {
  if (!g.clamp) return;
  for (int64_t i = 0; i < n; ++i) y[i] = std::min(std::max(y[i], g.lo), g.hi);
}

// The fused activation (hard-swish, SiLU, ...) over n results still in cache.
void activate(const Geometry& g, float* y, int64_t n) {
  if (g.act >= 0) unary_cpu_map(static_cast<UnaryKernel>(g.act))(y, y, n);
}

bool has_epilogue(const Geometry& g) { return g.clamp || g.act >= 0; }

// The clamp, then the activation: the epilogue of every path.
void finish(const Geometry& g, float* y, int64_t n) {
  clamp_range(g, y, n);
  activate(g, y, n);
}

// The output plane's starting values: the bias, plus the residual's plane when there is one.
void init_plane(const Geometry& g, float* out, float bias, const float* residual) {
  if (residual) {
    for (int64_t i = 0; i < g.P(); ++i) out[i] = residual[i] + bias;
  } else {
    std::fill(out, out + g.P(), bias);
  }
}

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

// depthwise_block on sixteen lanes (AVX-512F), for maps wide enough to fill them.
template <int R, int V>
MLXD_AVX512 void depthwise_block16(const Geometry& g, const PaddedPlane& pp, const DwRow& d, int oh, int ow, int rows,
                                   __mmask16 tail) {
  const __m512 bias = _mm512_set1_ps(_mm256_cvtss_f32(d.bias));
  const __m512 lo = _mm512_set1_ps(_mm256_cvtss_f32(d.lo)), hi = _mm512_set1_ps(_mm256_cvtss_f32(d.hi));
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      acc[r][v] = bias;
      if (d.residual && r < rows) {
        const float* res = d.residual + int64_t{oh + r} * g.OW + ow + 16 * v;
        acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_maskz_loadu_ps(v == V - 1 ? tail : __mmask16(0xFFFF), res));
      }
    }
  const int64_t row_step = int64_t{g.sh} * pp.row;
  const float* top = d.buf + int64_t{oh} * row_step + ow;
  const int taps = g.KH * g.KW;
  for (int t = 0; t < taps; ++t) {
    const __m512 w = _mm512_set1_ps(d.k[t]);
    const float* p = top + pp.taps[t];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(p + r * row_step + 16 * v), acc[r][v]);
  }
  for (int r = 0; r < R && r < rows; ++r)
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(d.out + int64_t{oh + r} * g.OW + ow + 16 * v, v == V - 1 ? tail : __mmask16(0xFFFF),
                            _mm512_min_ps(hi, _mm512_max_ps(lo, acc[r][v])));
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
  if (g.OW >= 28 && cpu_use_avx512())
    depthwise_rows16(g, pp, d);  // sixteen lanes: at most 4 of 32 columns of a vector pair wasted
  else if (g.OW > 16)
    depthwise_rows<2>(g, pp, d);  // 2 rows x up to 4 vectors
  else
    depthwise_rows<kDwRows>(g, pp, d);  // 4 rows x 1-2 vectors
  activate(g, out, g.P());
}
#endif

// One output plane per (image, channel) of a convolution with one input channel per group.
bool depthwise_padded_on();
void depthwise(const Geometry& g, const float* x, const float* w, int64_t w_image, const float* bias,
               const float* residual, float* y) {
  const int m = g.Og();  // output channels per input channel
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2() && (g.sw == 1 || g.sw == 2) && depthwise_padded_on()) {
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

// The tiled paths (run_tiled, the channel blocks, the padded depthwise rows):
// on unless MLX_DELEGATE_CONV_TILES=0; set_conv_tiles switches them per call
// for A/B runs in one process.
std::atomic<bool>& tiles_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("MLX_DELEGATE_CONV_TILES");
    return !(e && std::string(e) == "0");
  }()};
  return on;
}

// The padded depthwise rows ride the same switch (off: the portable row-by-row loop; A/B, tests).
bool depthwise_padded_on() { return tiles_flag().load(std::memory_order_relaxed); }

// Floats per tile (512 KB): a tile's im2col columns (none for a 1x1 stride-1
// convolution, which reads the input in place) and its output block stay in a
// core's L2 from the copy through the product to the clamp.
constexpr int64_t kTileFloats = int64_t{1} << 17;
// Weights up to this many floats (1 MB) are re-read per tile from cache; larger
// ones (deep layers, whose im2col is small anyway) keep the whole-image product.
constexpr int64_t kTileMaxWeights = int64_t{1} << 18;

// Tiles per image (output-row bands) when the tiled path applies to this per-image product, else 0.
// `direct`: a 1x1 product on the input planes (no im2col). The tile count is rounded up so that the
// images' tiles together divide evenly among the pool's threads, and the bands are of equal height
// (within a row): ResNet-50's 256->1024 1x1 convolution at 14x14 was two tiles of 9 and 5 rows, one
// per thread, its 128->512 at 28x28 four tiles of 9, 9, 9 and 1 rows.
int tile_count(const Geometry& g, bool direct) {
  const int64_t K = int64_t{g.Cg()} * g.KH * g.KW;
  if (!tiles_flag().load(std::memory_order_relaxed) || serial_sgemm() == nullptr) return 0;
  const int64_t per_column = direct ? g.Og() : K;  // what a tile holds per output column
  if (K * g.Og() > kTileMaxWeights || per_column * g.P() <= kTileFloats) return 0;  // one tile: nothing to gain
  const int64_t rows = std::clamp<int64_t>(kTileFloats / (per_column * g.OW), 1, g.OH);
  const int64_t others = int64_t{g.N} * g.groups, threads = cpu_pool_threads();
  int64_t tiles = (g.OH + rows - 1) / rows;
  while ((others * tiles) % threads != 0 && tiles < g.OH) ++tiles;
  return static_cast<int>(tiles);
}

// One image's product in `tiles` bands of output rows, each on one thread:
// im2col of the tile into a per-thread buffer (unless `direct`), the bias /
// residual written into the tile's output columns, a single-threaded sgemm
// adding onto them, then the clamp. The whole [K, OH * OW] im2col matrix (9x
// the input for a 3x3 convolution) never goes through memory, and the output
// is written once instead of once per pass.
void run_tiled(const Geometry& g, int tiles, bool direct, const float* x, const float* w, int64_t w_image,
               const float* bias, const float* residual, float* y) {
  const int K = g.Cg() * g.KH * g.KW, M = g.Og();
  const int64_t P = g.P();
  const SerialSgemmFn gemm = serial_sgemm();
  const int64_t items = int64_t{g.N} * g.groups * tiles;
  const int max_rows = (g.OH + tiles - 1) / tiles;
  cpu_parallel_for(items, int64_t{K} * M * max_rows * g.OW, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> cols;
    for (int64_t t = begin; t < end; ++t) {
      const int tile = static_cast<int>(t % tiles), gi = static_cast<int>(t / tiles % g.groups);
      const int n = static_cast<int>(t / tiles / g.groups);
      const int oh0 = tile * g.OH / tiles, oh1 = (tile + 1) * g.OH / tiles;
      const int T = (oh1 - oh0) * g.OW;
      const float* xg = x + (int64_t{n} * g.C + int64_t{gi} * g.Cg()) * g.H * g.W;
      if (!direct) {
        cols.resize(int64_t{K} * T);
        for (int r = 0; r < K; ++r) {
          const int c = r / (g.KH * g.KW), ki = r / g.KW % g.KH, kj = r % g.KW;
          im2col_row(g, xg + int64_t{c} * g.H * g.W, ki, kj, oh0, oh1, cols.data() + int64_t{r} * T);
        }
      }
      const int64_t first = (int64_t{n} * g.O + int64_t{gi} * M) * P + int64_t{oh0} * g.OW;
      float* yt = y + first;
      for (int o = 0; o < M; ++o) {
        float* dst = yt + o * P;
        const float bv = bias ? bias[gi * M + o] : 0.f;
        if (residual) {
          const float* res = residual + first + o * P;
          for (int q = 0; q < T; ++q) dst[q] = res[q] + bv;
        } else {
          std::fill(dst, dst + T, bv);
        }
      }
      // direct: the input's planes are B in place (row stride P), from the tile's first column.
      const float* b = direct ? xg + int64_t{oh0} * g.OW : cols.data();
      gemm(0, 0, M, T, K, 1.f, w + n * w_image + int64_t{gi} * M * K, K, b, direct ? static_cast<int>(P) : T, 1.f, yt,
           static_cast<int>(P));
      if (has_epilogue(g))
        for (int o = 0; o < M; ++o) finish(g, yt + o * P, T);
    }
  });
}

// An input scale per image and channel (x * s[n, c], a squeeze-excite gate)
// folded into whichever operand is smaller: a per-image copy of the weights
// (returns the stride between the copies; w points at them), else a scaled
// copy of the input (returns 0; x points at it). One parallel pass either way,
// instead of a broadcast multiply writing a new activation before the call.
int64_t fold_scale(const Geometry& g, const float* s, const float*& x, const float*& w, std::vector<float>& buf) {
  const int taps = g.KH * g.KW, Cg = g.Cg(), Og = g.Og();
  const int64_t per_o = int64_t{Cg} * taps, w_n = g.O * per_o, plane = int64_t{g.H} * g.W;
  if (w_n <= g.C * plane) {
    buf.resize(g.N * w_n);
    const float* src = w;
    cpu_parallel_for(int64_t{g.N} * g.O, per_o, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t / g.O, o = t % g.O;
        const float* sc = s + n * g.C + o / Og * Cg;  // the scales of this output channel's group
        const float* from = src + o * per_o;
        float* to = buf.data() + t * per_o;
        for (int c = 0; c < Cg; ++c)
          for (int k = 0; k < taps; ++k) to[c * taps + k] = from[c * taps + k] * sc[c];
      }
    });
    w = buf.data();
    return w_n;
  }
  buf.resize(int64_t{g.N} * g.C * plane);
  const float* src = x;
  cpu_parallel_for(int64_t{g.N} * g.C, plane, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float sv = s[t], *from = src + t * plane;
      float* to = buf.data() + t * plane;
      for (int64_t i = 0; i < plane; ++i) to[i] = from[i] * sv;
    }
  });
  x = buf.data();
  return 0;
}

struct ConvCall {
  Tensor x, w;
  std::optional<Tensor> bias, residual, scale, wino;  // wino: the weights in the Winograd domain
  void* y;
  mx::Dtype out_dtype;
  Geometry g;
};

void run_conv(const ConvCall& c) {
  const Geometry& g = c.g;
  std::vector<float> xs, ws, bs, rs, ss, ys, cols;
  const float* x = as_f32(c.x, xs);
  const float* w = as_f32(c.w, ws);
  const float* bias = c.bias ? as_f32(*c.bias, bs) : nullptr;
  const float* residual = c.residual ? as_f32(*c.residual, rs) : nullptr;
  // Kept per thread across calls: a fresh vector of a few hundred KB is a fresh mapping (page faults) each call.
  thread_local std::vector<float> scaled;
  const int64_t w_image = c.scale ? fold_scale(g, as_f32(*c.scale, ss), x, w, scaled) : 0;
  const int64_t out_n = int64_t{g.N} * g.O * g.P();
  float* y = static_cast<float*>(c.y);
  if (c.out_dtype != mx::float32) {
    ys.resize(out_n);
    y = ys.data();
  }
  const WinogradGeometry wg{g.N, g.C, g.H, g.W, g.O, g.OH, g.OW, g.ph, g.pw, g.clamp, g.lo, g.hi, g.act};
  const bool wino_ok = g.KH == 3 && g.KW == 3 && g.sh == 1 && g.sw == 1 && g.dh == 1 && g.dw == 1 &&
                       g.groups == 1 && !c.scale;
  if (const int m = winograd_tile(wg, wino_ok)) {  // else (switched off, another shape): im2col below
    cpu_kernel_note_call(m == 2 ? "conv_winograd2" : "conv_winograd4");
    const bool given = c.wino && c.wino->contiguous && c.wino->shape[0] == (m + 2) * (m + 2);
    thread_local std::vector<float> made;  // weights that are not a constant (or another tile): each call
    if (!given) {
      made.resize(size_t(m + 2) * (m + 2) * g.O * g.C);
      winograd_weights(w, g.O, g.C, m, made.data());
    }
    winograd_conv(wg, m, x, given ? static_cast<const float*>(c.wino->data) : made.data(), bias, residual, y);
  } else if (g.Cg() == 1) {
    depthwise(g, x, w, w_image, bias, residual, y);
  } else {
    const bool direct = g.KH == 1 && g.KW == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0 &&
                        g.OH == g.H && g.OW == g.W;
    const int K = g.Cg() * g.KH * g.KW, M = g.Og();
    const int64_t P = g.P();
    // Per-image weights (a folded input scale) rule out sharing one product between images.
    const int nb = w_image ? 1 : static_cast<int>(std::min<int64_t>(g.N, std::max<int64_t>(1, (batch_columns() + P - 1) / P)));
    const int tiles = nb != 1 ? 0 : tile_count(g, direct);
    if (tiles > 0) {
      cpu_kernel_note_call("conv_tiled");
      run_tiled(g, tiles, direct, x, w, w_image, bias, residual, y);
    } else if (nb == 1) {  // per image: the sgemm writes the result in place
      if (!direct) cols.resize(int64_t{K} * P);
      // Blocks of output channels, each on one thread (init, product, clamp in one task): one
      // hand-off to the pool per product instead of three. Off with the tiles (A/B).
      const bool blocked = tiles_flag().load(std::memory_order_relaxed) && serial_sgemm() != nullptr;
      if (blocked) cpu_kernel_note_call("conv_row_blocks");
      for (int n = 0; n < g.N; ++n) {
        for (int gi = 0; gi < g.groups; ++gi) {
          const float* xg = x + (int64_t{n} * g.C + int64_t{gi} * g.Cg()) * g.H * g.W;
          const int64_t first = (int64_t{n} * g.O + int64_t{gi} * M) * P;
          float* yg = y + first;
          if (!direct) im2col(g, x, n, 1, gi, cols.data(), P);
          const float* bmat = direct ? xg : cols.data();
          const float* wg = w + n * w_image + int64_t{gi} * M * K;
          if (blocked) {  // one pass over blocks of output channels: bias / residual, sgemm, clamp
            // One block per pool thread: each block's sgemm packs the whole [K, P] operand again (at a
            // 7x7 map about as much as its weights); four blocks a thread read it four times over.
            const int parts = int64_t{M} * K * P >= kCpuMinParallel ? cpu_pool_threads() : 1;
            cpu_parallel_parts(parts, [&](int part) {
              int64_t lo = int64_t{M} * part / parts, hi = int64_t{M} * (part + 1) / parts;
              lo -= lo % 16;  // blocks of whole 16-channel groups, the last to M
              hi = part + 1 == parts ? M : hi - hi % 16;
              if (lo >= hi) return;
              for (int64_t o = lo; o < hi; ++o)
                init_plane(g, yg + o * P, bias ? bias[gi * M + o] : 0.f,
                           residual ? residual + first + o * P : nullptr);
              serial_sgemm()(0, 0, static_cast<int>(hi - lo), static_cast<int>(P), K, 1.f, wg + lo * K, K, bmat,
                             static_cast<int>(P), 1.f, yg + lo * P, static_cast<int>(P));
              finish(g, yg + lo * P, (hi - lo) * P);
            });
            continue;
          }
          // The sgemm adds onto bias + residual (beta 1), so neither costs a pass of its own.
          if (bias || residual) {
            cpu_parallel_for(M, residual ? 2 * P : P, 1, [&](int64_t b, int64_t e) {
              for (int64_t o = b; o < e; ++o)
                init_plane(g, yg + o * P, bias ? bias[gi * M + o] : 0.f,
                           residual ? residual + first + o * P : nullptr);
            });
          }
          sgemm()(kRowMajor, kNoTrans, kNoTrans, M, static_cast<int>(P), K, 1.f, wg, K,
                  direct ? xg : cols.data(), static_cast<int>(P), bias || residual ? 1.f : 0.f, yg,
                  static_cast<int>(P));
          if (has_epilogue(g))
            cpu_parallel_for(M, P, 1, [&](int64_t b, int64_t e) { finish(g, yg + b * P, (e - b) * P); });
        }
      }
    } else {  // nb images per sgemm into z [M, nb * P]; one pass moves it to NCHW with bias, residual, clamp
      cols.resize(int64_t{K} * nb * P);
      std::vector<float> z(int64_t{M} * nb * P);
      for (int n0 = 0; n0 < g.N; n0 += nb) {
        const int count = std::min(nb, g.N - n0);
        const int64_t ld = count * P;
        for (int gi = 0; gi < g.groups; ++gi) {
          im2col(g, x, n0, count, gi, cols.data(), ld);
          sgemm()(kRowMajor, kNoTrans, kNoTrans, M, static_cast<int>(ld), K, 1.f, w + int64_t{gi} * M * K, K,
                  cols.data(), static_cast<int>(ld), 0.f, z.data(), static_cast<int>(ld));
          cpu_parallel_for(int64_t{count} * M, residual ? 3 * P : 2 * P, 1, [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
              const int64_t image = t / M, o = t % M;
              const int64_t at = ((n0 + image) * g.O + int64_t{gi} * M + o) * P;
              const float* src = z.data() + o * ld + image * P;
              float* dst = y + at;
              const float bv = bias ? bias[gi * M + o] : 0.f;
              if (residual) {
                for (int64_t q = 0; q < P; ++q) dst[q] = src[q] + bv + residual[at + q];
              } else {
                for (int64_t q = 0; q < P; ++q) dst[q] = src[q] + bv;
              }
              finish(g, dst, P);
            }
          });
        }
      }
    }
  }
  if (c.out_dtype != mx::float32) cpu_store_f32(y, c.out_dtype, 0, out_n, c.y);
}

class ConvCpu : public mx::UnaryPrimitive {
 public:
  ConvCpu(mx::Stream s, Geometry g, bool has_bias, bool has_residual, bool has_scale, bool has_wino)
      : mx::UnaryPrimitive(s), g_(g), has_bias_(has_bias), has_residual_(has_residual), has_scale_(has_scale),
        has_wino_(has_wino) {}

  // in: x [N, C, H, W], w [O, C/g, KH, KW], then the bias [O], the residual
  // [N, O, OH, OW], the input scale [N, C] and the Winograd weights when present; any strides.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    Geometry g = g_;
    g.N = in[0].shape(0);
    ConvCall c{tensor(in[0]), tensor(in[1]), {}, {}, {}, {}, out.data<void>(), out.dtype(), g};
    size_t i = 2;
    if (has_bias_) c.bias = tensor(in[i++]);
    if (has_residual_) c.residual = tensor(in[i++]);
    if (has_scale_) c.scale = tensor(in[i++]);
    if (has_wino_) c.wino = tensor(in[i]);
    cpu_kernel_note_call(g.Cg() == 1 ? "conv_depthwise" : "conv_gemm");
    encoder.dispatch([c = std::move(c)] { run_conv(c); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ConvCpu runs on the CPU only");
  }
  const char* name() const override { return "ConvCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const ConvCpu&>(other);
    // The ints (the activation's included) compared as one block (no padding among them), then the clamp.
    return std::memcmp(&g_, &o.g_, offsetof(Geometry, clamp)) == 0 && g_.clamp == o.g_.clamp &&
           g_.lo == o.g_.lo && g_.hi == o.g_.hi && has_bias_ == o.has_bias_ &&
           has_residual_ == o.has_residual_ && has_scale_ == o.has_scale_ && has_wino_ == o.has_wino_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {{in[0].shape(0), g_.O, g_.OH, g_.OW}};
  }

 private:
  Geometry g_;
  bool has_bias_, has_residual_, has_scale_, has_wino_;
};

}  // namespace

void set_conv_tiles(bool on) { tiles_flag().store(on, std::memory_order_relaxed); }
bool conv_tiles() { return tiles_flag().load(std::memory_order_relaxed); }

namespace {

int out_size(int in, int k, int s, int lo, int hi, int d) { return (in + lo + hi - d * (k - 1) - 1) / s + 1; }

}  // namespace

bool conv_cpu_applies(const mx::array& x, const mx::array& w, const mx::array* bias, int groups,
                      const mx::array* residual, const mx::array* in_scale) {
  if (!cpu_kernels_active() || sgemm() == nullptr || groups < 1) return false;
  if (!cpu_kernel_dtype_ok(x) || w.dtype() != x.dtype() || w.size() == 0) return false;
  if ((x.ndim() != 3 && x.ndim() != 4) || w.ndim() != x.ndim()) return false;
  if (residual && (residual->dtype() != x.dtype() || residual->ndim() != x.ndim())) return false;
  if (in_scale && in_scale->dtype() != x.dtype()) return false;
  return !bias || (cpu_kernel_dtype_ok(*bias) && bias->size() == static_cast<size_t>(w.shape(0)));
}

mx::array conv_cpu(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                   const std::vector<int>& stride, const std::vector<int>& padding, const std::vector<int>& dilation,
                   int groups, std::optional<std::pair<float, float>> clamp, const std::vector<int>& padding_hi,
                   const std::optional<mx::array>& residual, std::optional<UnaryKernel> act,
                   const std::optional<mx::array>& in_scale, const std::optional<mx::array>& winograd_w) {
  if (!conv_cpu_applies(x, w, bias ? &*bias : nullptr, groups, residual ? &*residual : nullptr,
                        in_scale ? &*in_scale : nullptr))
    throw std::invalid_argument("conv_cpu: operands it does not take");
  const bool one_d = x.ndim() == 3;
  const size_t nd = one_d ? 1 : 2;
  const std::vector<int>& pad_hi = padding_hi.empty() ? padding : padding_hi;
  if (stride.size() != nd || padding.size() != nd || dilation.size() != nd || pad_hi.size() != nd)
    throw std::invalid_argument("conv: stride, padding and dilation need one entry per spatial axis");
  // A 1-D convolution is a 2-D one over a height-1 image.
  auto at = [&](const std::vector<int>& v, int axis, int fill) { return one_d ? (axis ? v[0] : fill) : v[axis]; };
  // ph / pw: the low side's padding; the high side's only sets the output size (the kernel
  // bounds every read by the input's extent).
  Geometry g{x.shape(0), x.shape(1), one_d ? 1 : x.shape(2), x.shape(-1), w.shape(0), one_d ? 1 : w.shape(2),
             w.shape(-1), 0, 0, at(stride, 0, 1), at(stride, 1, 1), at(padding, 0, 0), at(padding, 1, 0),
             at(dilation, 0, 1), at(dilation, 1, 1), groups, act ? static_cast<int>(*act) : -1, clamp.has_value(),
             clamp ? clamp->first : 0.f,
             clamp ? clamp->second : 0.f};
  const int phh = at(pad_hi, 0, 0), pwh = at(pad_hi, 1, 0);
  if (g.C % groups || g.O % groups || w.shape(1) != g.C / groups)
    throw std::invalid_argument("conv: weight " + std::to_string(w.shape(0)) + "x" + std::to_string(w.shape(1)) +
                                " does not fit " + std::to_string(g.C) + " input channels in " +
                                std::to_string(groups) + " groups");
  if (std::min({g.sh, g.sw, g.dh, g.dw}) < 1 || std::min({g.ph, g.pw, phh, pwh}) < 0)
    throw std::invalid_argument("conv: stride and dilation must be positive, padding non-negative");
  if (g.H + g.ph + phh < g.dh * (g.KH - 1) + 1 || g.W + g.pw + pwh < g.dw * (g.KW - 1) + 1)
    throw std::invalid_argument("conv: kernel is larger than the padded input");
  g.OH = out_size(g.H, g.KH, g.sh, g.ph, phh, g.dh);
  g.OW = out_size(g.W, g.KW, g.sw, g.pw, pwh, g.dw);
  std::vector<mx::array> inputs{x, w};
  if (bias) inputs.push_back(mx::flatten(*bias));
  if (residual) {
    const mx::Shape want = one_d ? mx::Shape{g.N, g.O, g.OW} : mx::Shape{g.N, g.O, g.OH, g.OW};
    if (residual->shape() != want) throw std::invalid_argument("conv: the residual does not have the output's shape");
    inputs.push_back(one_d ? mx::reshape(*residual, {g.N, g.O, g.OH, g.OW}) : *residual);
  }
  if (in_scale) {
    if (in_scale->size() != static_cast<size_t>(g.N) * g.C)
      throw std::invalid_argument("conv: the input scale needs one value per image and input channel");
    inputs.push_back(mx::reshape(*in_scale, {g.N, g.C}));
  }
  if (winograd_w && winograd_weights_tile(*winograd_w, g.O, g.C) == 0)
    throw std::invalid_argument("conv: Winograd weights of another shape than the convolution's");
  if (winograd_w) inputs.push_back(*winograd_w);
  auto prim = std::make_shared<ConvCpu>(mx::default_stream(mx::Device::cpu), g, bias.has_value(), residual.has_value(),
                                        in_scale.has_value(), winograd_w.has_value());
  auto y = mx::array({g.N, g.O, g.OH, g.OW}, x.dtype(), std::move(prim), std::move(inputs));
  return one_d ? mx::reshape(y, {g.N, g.O, g.OW}) : y;
}

}  // namespace mlxd::rt
