// Convolutions with few input channels (a CNN's stem: RGB in, 16-64 channels out) computed directly
// (conv_cpu.h). As im2col + sgemm they are products of K = C * kh * kw = 27 rows for a 3x3 stem: the
// im2col copy (1.35 MB for a 224 x 224 image) costs as much as the product, and the product's tile
// runs half empty on 16 output channels (MobileNetV3-Large's stem took ~150 us, 5x its FMA count, on
// the AVX-512 EPYC, 2026-11-28). Here each vector of output columns is summed tap by tap in registers:
// a block of output channels times a few vectors of columns, one input vector loaded per tap and
// shared by the block, each weight broadcast. The input rows are first copied with their zero border
// and, at width stride s, split into s phases (column j of phase q is padded column j * s + q), so
// every tap reads consecutive floats and the loops have no edge cases.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/conv_cpu.h"
#include "kernels/conv_cpu_internal.h"
#include "kernels/cpu_parallel.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt::conv_detail {
namespace {

std::atomic<bool>& direct_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("MLX_DELEGATE_CONV_DIRECT");
    return !(e && std::string(e) == "0");
  }()};
  return on;
}

#ifdef MLXD_CPU_X86
// Input channels up to this many take the direct path: past a few, im2col's K is deep enough for the
// sgemm's tile, whose weight reuse the direct loop lacks.
constexpr int kMaxChannels = 4;
// Taps (C * KH * KW) at most: a 7x7 stem on four channels.
constexpr int kMaxTaps = kMaxChannels * 7 * 7;
// Output rows per task at most: a task's phase rows (channels x input rows x (OW + kw) floats) stay in L2.
constexpr int kMaxBandRows = 16;

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef int I16 __attribute__((vector_size(64)));
typedef int I8 __attribute__((vector_size(32)));
template <class V>
struct Lanes;  // the matching vector of ints (shuffle masks)
template <>
struct Lanes<V16> {
  using I = I16;
};
template <>
struct Lanes<V8> {
  using I = I8;
};

template <class V>
[[gnu::always_inline]] inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class V>
[[gnu::always_inline]] inline void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// The band's input rows in phases: rows[(c * KH + ki) ...] is found by phase_row().
struct Phases {
  int first_ih;     // the padded input row the band's first output row reads first (may be < 0)
  int rows;         // input rows held per channel
  int64_t len;      // floats per phase row: the output columns rounded up to whole vectors, plus the taps' reach
  int stride;       // sw: phases per row
  float* data;      // [C][rows][stride][len]; a row outside the image is all zeros
  const float* row(int c, int ih) const { return data + ((int64_t{c} * rows + (ih - first_ih)) * stride) * len; }
};

// out[i] = in[2 * i] for i < count, a vector at a time (two loads, one shuffle) while the loads stay
// within the `avail` floats from in.
template <class V>
[[gnu::always_inline]] inline void take_even(const float* in, int64_t avail, int count, float* out) {
  constexpr int L = sizeof(V) / sizeof(float);
  typename Lanes<V>::I even;
  for (int i = 0; i < L; ++i) even[i] = 2 * i;
  int i = 0;
  for (; i + L <= count && 2 * int64_t{i} + 2 * L <= avail; i += L)
    store(out + i, __builtin_shuffle(load<V>(in + 2 * i), load<V>(in + 2 * i + L), even));
  for (; i < count; ++i) out[i] = in[2 * int64_t{i}];
}

// Fills the band's phase rows for input rows [first_ih, first_ih + rows) of image n.
template <class V>
[[gnu::always_inline]] inline void fill_phases(const Geometry& g, const float* x, int n, Phases& ph) {
  for (int c = 0; c < g.C; ++c) {
    const float* plane = x + (int64_t{n} * g.C + c) * g.H * g.W;
    for (int r = 0; r < ph.rows; ++r) {
      const int ih = ph.first_ih + r;
      float* dst = ph.data + ((int64_t{c} * ph.rows + r) * ph.stride) * ph.len;
      if (ih < 0 || ih >= g.H) {
        std::fill(dst, dst + ph.stride * ph.len, 0.f);
        continue;
      }
      const float* src = plane + int64_t{ih} * g.W;
      for (int q = 0; q < ph.stride; ++q) {
        float* out = dst + q * ph.len;
        // Phase column j is input column j * s + q - pw: inside the row for j in [lo, hi).
        const int lo = std::min<int64_t>(ph.len, std::max(0, (g.pw - q + ph.stride - 1) / ph.stride));
        const int64_t last = int64_t{g.W} - 1 + g.pw - q;  // the last in-row column's padded index
        const int hi = std::clamp<int64_t>(last < 0 ? 0 : last / ph.stride + 1, lo, ph.len);
        std::fill(out, out + lo, 0.f);
        const float* in = src + (int64_t{lo} * ph.stride + q - g.pw);
        if (ph.stride == 1) {
          std::memcpy(out + lo, in, sizeof(float) * (hi - lo));
        } else if (ph.stride == 2) {
          take_even<V>(in, src + g.W - in, hi - lo, out + lo);
        } else {
          for (int j = lo; j < hi; ++j) out[j] = in[int64_t{j - lo} * ph.stride];
        }
        std::fill(out + hi, out + ph.len, 0.f);
      }
    }
  }
}

// One output row's taps inside the image: where each reads in the phase rows (ow = 0's input) and
// its weight's index in a row of w ([O, C * KH * KW]). Rows above or below the image are left out.
struct Taps {
  int count = 0;
  int64_t src[kMaxTaps];
  int w[kMaxTaps];
};

void row_taps(const Geometry& g, const Phases& ph, int oh, Taps& taps) {
  taps.count = 0;
  for (int c = 0; c < g.C; ++c)
    for (int ki = 0; ki < g.KH; ++ki) {
      const int ih = oh * g.sh - g.ph + ki;
      if (ih < 0 || ih >= g.H) continue;
      const int64_t row = ph.row(c, ih) - ph.data;
      for (int kj = 0; kj < g.KW; ++kj) {
        taps.src[taps.count] = row + (kj % ph.stride) * ph.len + kj / ph.stride;
        taps.w[taps.count++] = (c * g.KH + ki) * g.KW + kj;
      }
    }
}

// Output channels [o0, o0 + OB) of output row oh, columns [ow0, ow0 + WB * L): the bias, the sums over
// the row's taps, the residual and the clamp, in registers, stored into y's rows (row stride P); a
// vector reaching past OW is stored in part.
template <class V, int OB, int WB>
[[gnu::always_inline]] inline void block(const Geometry& g, const Phases& ph, const Taps& taps, const float* w,
                                         const float* bias, const float* residual, int o0, int oh, int ow0,
                                         float* y) {
  constexpr int L = sizeof(V) / sizeof(float);
  const int64_t K = int64_t{g.C} * g.KH * g.KW;
  const float* wo = w + o0 * K;
  const float* base = ph.data + ow0;
  V acc[OB][WB];
  for (int j = 0; j < OB; ++j)
    for (int u = 0; u < WB; ++u) acc[j][u] = V{} + (bias ? bias[o0 + j] : 0.f);
  for (int t = 0; t < taps.count; ++t) {
    const float* src = base + taps.src[t];
    const float* wk = wo + taps.w[t];
    V xv[WB];
    for (int u = 0; u < WB; ++u) xv[u] = load<V>(src + u * L);
    for (int j = 0; j < OB; ++j) {
      const float wv = wk[j * K];
      for (int u = 0; u < WB; ++u) acc[j][u] += xv[u] * wv;
    }
  }
  const V lo = V{} + g.lo, hi = V{} + g.hi;
  for (int j = 0; j < OB; ++j) {
    const int64_t at = int64_t{o0 + j} * g.P() + int64_t{oh} * g.OW + ow0;
    for (int u = 0; u < WB; ++u) {
      const int left = std::min(g.OW - ow0 - u * L, L);
      if (left <= 0) continue;
      V v = acc[j][u];
      float part[L];
      if (residual) {
        if (left == L) {
          v += load<V>(residual + at + u * L);
        } else {
          std::fill(part, part + L, 0.f);
          std::memcpy(part, residual + at + u * L, sizeof(float) * left);
          v += load<V>(part);
        }
      }
      if (g.clamp) {
        v = v < lo ? lo : v;
        v = v > hi ? hi : v;
      }
      if (left == L) {
        store(y + at + u * L, v);
      } else {
        store(part, v);
        std::memcpy(y + at + u * L, part, sizeof(float) * left);
      }
    }
  }
}

// One output row's channels [o0, o0 + OB): WB vectors of columns at a time, then one at a time.
template <class V, int OB, int WB>
[[gnu::always_inline]] inline void row_block(const Geometry& g, const Phases& ph, const Taps& taps, const float* w,
                                             const float* bias, const float* residual, int o0, int oh, float* y) {
  constexpr int L = sizeof(V) / sizeof(float);
  int ow = 0;
  for (; ow + WB * L <= g.OW; ow += WB * L) block<V, OB, WB>(g, ph, taps, w, bias, residual, o0, oh, ow, y);
  for (; ow < g.OW; ow += L) block<V, OB, 1>(g, ph, taps, w, bias, residual, o0, oh, ow, y);
}

// Image n's output rows [oh0, oh1) into y (the image's first output plane): phases, sums, epilogue.
template <class V, int OB, int WB>
[[gnu::always_inline]] inline void band(const Geometry& g, const float* x, const float* w, const float* bias,
                                        const float* residual, int n, int oh0, int oh1, float* y) {
  constexpr int L = sizeof(V) / sizeof(float);
  thread_local std::vector<float> scratch;
  Phases ph;
  ph.stride = g.sw;
  ph.first_ih = oh0 * g.sh - g.ph;
  ph.rows = (oh1 - 1 - oh0) * g.sh + g.KH;
  ph.len = (int64_t{g.OW} + L - 1) / L * L + (g.KW - 1) / g.sw + 1;
  at_least(scratch, int64_t{g.C} * ph.rows * ph.stride * ph.len);
  ph.data = scratch.data();
  fill_phases<V>(g, x, n, ph);
  Taps taps;
  for (int oh = oh0; oh < oh1; ++oh) {
    row_taps(g, ph, oh, taps);
    int o = 0;
    for (; o + OB <= g.O; o += OB) row_block<V, OB, WB>(g, ph, taps, w, bias, residual, o, oh, y);
    for (; o < g.O; ++o) row_block<V, 1, WB>(g, ph, taps, w, bias, residual, o, oh, y);
    if (g.act >= 0)  // the activation (hard-swish, ...) on the row's results while they are in cache
      for (o = 0; o < g.O; ++o) activate(g, y + int64_t{o} * g.P() + int64_t{oh} * g.OW, g.OW);
  }
}

// Eight output channels by three vectors: 24 accumulators and 3 inputs of the 32 registers.
MLXD_AVX512 void band_avx512(const Geometry& g, const float* x, const float* w, const float* bias,
                             const float* residual, int n, int oh0, int oh1, float* y) {
  band<V16, 8, 3>(g, x, w, bias, residual, n, oh0, oh1, y);
}

// Four output channels by three vectors: 12 accumulators and 3 inputs of the 16 registers.
MLXD_AVX2 void band_avx2(const Geometry& g, const float* x, const float* w, const float* bias,
                         const float* residual, int n, int oh0, int oh1, float* y) {
  band<V8, 4, 3>(g, x, w, bias, residual, n, oh0, oh1, y);
}
#endif

}  // namespace

bool direct_applies(const Geometry& g, int64_t w_image) {
#ifdef MLXD_CPU_X86
  return direct_flag().load(std::memory_order_relaxed) && cpu_use_avx2() && g.groups == 1 && g.C <= kMaxChannels &&
         g.dh == 1 && g.dw == 1 && w_image == 0 && g.sw <= 4 && g.C * g.KH * g.KW <= kMaxTaps;
#else
  (void)g, (void)w_image;
  return false;
#endif
}

void direct(const Geometry& g, const float* x, const float* w, const float* bias, const float* residual, float* y) {
#ifdef MLXD_CPU_X86
  const bool wide = cpu_use_avx512();
  // Bands of output rows: several per thread at batch 1 (the rows' costs differ at the borders), whole
  // images (up to kMaxBandRows rows) when there are images enough.
  const int64_t threads = cpu_pool_threads();
  const int per_image = static_cast<int>(std::clamp<int64_t>(
      std::max<int64_t>((4 * threads + g.N - 1) / g.N, (g.OH + kMaxBandRows - 1) / kMaxBandRows), 1, g.OH));
  const int64_t P = g.P(), cost = int64_t{g.O} * g.C * g.KH * g.KW * g.OW * ((g.OH + per_image - 1) / per_image);
  cpu_parallel_for(int64_t{g.N} * per_image, cost, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int n = static_cast<int>(t / per_image), b = static_cast<int>(t % per_image);
      const int oh0 = static_cast<int>(int64_t{g.OH} * b / per_image);
      const int oh1 = static_cast<int>(int64_t{g.OH} * (b + 1) / per_image);
      if (oh0 >= oh1) continue;
      float* yn = y + int64_t{n} * g.O * P;
      const float* rn = residual ? residual + int64_t{n} * g.O * P : nullptr;
      (wide ? band_avx512 : band_avx2)(g, x, w, bias, rn, n, oh0, oh1, yn);
    }
  });
#else
  (void)g, (void)x, (void)w, (void)bias, (void)residual, (void)y;
#endif
}

}  // namespace mlxd::rt::conv_detail

namespace mlxd::rt {
void set_conv_direct(bool on) { conv_detail::direct_flag().store(on, std::memory_order_relaxed); }
bool conv_direct() { return conv_detail::direct_flag().load(std::memory_order_relaxed); }
}  // namespace mlxd::rt
