// Inverted-residual block on the CPU (see block_cpu.h).
//
// Small maps run whole (run_channels), the smallest (14x14, 7x7) pixel by pixel
// (block_pixels_cpu.cpp). On larger ones, per image, the output
// rows are cut into one band per pool thread; a band is
// walked in tiles of T output rows. A tile needs the padded input rows
// [r0 * sh, (r1 - 1) * sh + KH) of the expanded activation; those it shares
// with the previous tile are moved to the front of the buffer, the others are
// computed by one sgemm (expand weight [E, C] times x's rows, read in place
// with row stride H * W), then bias + activation written into rows of Wp
// columns with zero borders, so the depthwise loop (block_depthwise_cpu.cpp)
// needs no bounds checks. The depthwise output [E, T * OW] feeds the project
// sgemm into the output rows, then bias + residual are added while in cache.
//
// Activations other than a clamp (hard-swish, ...) run as the unary kernels'
// maps over whole runs of channels while they are in cache. With
// squeeze-excite the block runs whole (run_channels): each channel block sums
// its channels' depthwise outputs and takes its share of the gate's reduce
// product, the calling thread adds the shares, and the gate scales the
// depthwise rows or is folded into the project weight's rows (the smaller).
#include "kernels/block_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/block_cpu_internal.h"
#include "kernels/cpu_parallel.h"
#include "kernels/unary_cpu.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {
using namespace block_detail;

// The kernel's two size limits (set_block_tiling): one thread's tile buffers
// (expanded rows, sgemm scratch, depthwise output), well inside a core's L2
// next to the weights; and the largest expanded map (E x H x W floats) run
// split over channels instead of row bands (run_channels). Environment:
// MLX_DELEGATE_BLOCK_TILE_KB, MLX_DELEGATE_BLOCK_CHANNELS_KB (0: never).
int64_t env_kb(const char* name, int64_t fallback) {
  const char* e = std::getenv(name);
  return e ? std::max<int64_t>(0, std::strtol(e, nullptr, 10)) : fallback;
}
std::atomic<int64_t>& tile_kb() {
  static std::atomic<int64_t> v{env_kb("MLX_DELEGATE_BLOCK_TILE_KB", 1024)};
  return v;
}
std::atomic<int64_t>& channels_kb() {
  static std::atomic<int64_t> v{env_kb("MLX_DELEGATE_BLOCK_CHANNELS_KB", 1024)};
  return v;
}
int64_t tile_budget() { return std::max<int64_t>(1, tile_kb().load(std::memory_order_relaxed)) * 1024; }
int64_t channel_split_limit() { return channels_kb().load(std::memory_order_relaxed) * 1024; }

// The function after the clamp over n values in place (none: nothing).
void act_map(const BlockActivation& a, float* v, int64_t n) {
  if (a.act >= 0) unary_cpu_map(static_cast<UnaryKernel>(a.act))(v, v, n);
}

struct Call {
  const float *x, *we, *be, *wd, *bd, *wp, *bp, *res, *wr, *br, *wx, *bx;
  float* y;
  const float *pe, *pp;  // the expand / project weights laid out for the serial sgemm's tile, or null
  const float* taps;  // the depthwise weight tap by tap (pixel-major form), or null
  std::atomic<bool>* packed;  // set when a product ran on a pack
};

#ifdef MLXD_CPU_X86
// Four rows at a time, eight lanes each, the tail of each row one by one.
MLXD_AVX2 void dot_rows_avx2(const float* w, int64_t ld, int rows, int len, const float* x, float* y) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int i = 0;
    for (; i + 8 <= len; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      for (int q = 0; q < 4; ++q) acc[q] = _mm256_fmadd_ps(_mm256_loadu_ps(w + (r + q) * ld + i), v, acc[q]);
    }
    for (int q = 0; q < 4; ++q) {
      float s = vmath::hsum8(acc[q]);
      for (int j = i; j < len; ++j) s += w[(r + q) * ld + j] * x[j];
      y[r + q] = s;
    }
  }
  for (; r < rows; ++r) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= len; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * ld + i), _mm256_loadu_ps(x + i), acc);
    float s = vmath::hsum8(acc);
    for (; i < len; ++i) s += w[r * ld + i] * x[i];
    y[r] = s;
  }
}

// dot_rows_avx2's scheme on sixteen lanes, the tail of each row masked.
MLXD_AVX512 void dot_rows_avx512(const float* w, int64_t ld, int rows, int len, const float* x, float* y) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % 16)) - 1);
  const int body = len - len % 16;
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int i = 0; i < body; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      for (int q = 0; q < 4; ++q) acc[q] = _mm512_fmadd_ps(_mm512_loadu_ps(w + (r + q) * ld + i), v, acc[q]);
    }
    if (tail) {
      const __m512 v = _mm512_maskz_loadu_ps(tail, x + body);
      for (int q = 0; q < 4; ++q)
        acc[q] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + (r + q) * ld + body), v, acc[q]);
    }
    for (int q = 0; q < 4; ++q) y[r + q] = _mm512_reduce_add_ps(acc[q]);
  }
  for (; r < rows; ++r) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < body; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * ld + i), _mm512_loadu_ps(x + i), acc);
    if (tail)
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w + r * ld + body), _mm512_maskz_loadu_ps(tail, x + body), acc);
    y[r] = _mm512_reduce_add_ps(acc);
  }
}
#endif

// y[r] = w[r, :len] . x for `rows` rows of stride ld: the squeeze-excite gate's small products, one
// pass over their weights (an sgemm of one column packed each weight first).
void dot_rows(const float* w, int64_t ld, int rows, int len, const float* x, float* y) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx512()) return dot_rows_avx512(w, ld, rows, len, x, y);
  if (cpu_use_avx2()) return dot_rows_avx2(w, ld, rows, len, x, y);
#endif
  for (int r = 0; r < rows; ++r) {  // in float64: one float32 running sum lost digits eager's products keep
    double s = 0.0;
    for (int i = 0; i < len; ++i) s += double(w[r * ld + i]) * x[i];
    y[r] = static_cast<float>(s);
  }
}

// Rows [r0, r0 + m) of a 1x1 weight [., k] (`rows`: row r0's values) times op(b) into c (beta 0 or 1):
// on the weight's pack where it has one that fits (serial_sgemm_packed), else on the plain rows.
void weight_gemm(const Call& call, const float* pack, const float* rows, int r0, int m, int k, int n, const float* b,
                 int ldb, float beta, float* c, int ldc, bool trans_b = false) {
  if (pack && serial_sgemm_packed(pack, r0, m, k, trans_b, n, 1.f, b, ldb, beta, c, ldc)) {
    call.packed->store(true, std::memory_order_relaxed);
    return;
  }
  serial_sgemm()(0, trans_b, m, n, k, 1.f, rows, k, b, ldb, beta, c, ldc);
}

// The same product written across, pixel by pixel: ct [n, m] (row stride ldct) = (rows b)^T, b [k, n].
void weight_gemm_ct(const Call& call, const float* pack, const float* rows, int r0, int m, int k, int n,
                    const float* b, int ldb, float* ct, int ldct) {
  if (pack && serial_sgemm_packed_ct(pack, r0, m, k, false, n, 1.f, b, ldb, 0.f, ct, ldct)) {
    call.packed->store(true, std::memory_order_relaxed);
    return;
  }
  serial_sgemm()(1, 1, n, m, k, 1.f, b, ldb, rows, k, 0.f, ct, ldct);
}

// Buffers a thread reuses from call to call (no page faults per call).
struct Scratch {
  std::vector<float> rows, gemm, dw, shared, weights;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

#ifdef MLXD_CPU_X86
MLXD_AVX2 float sum_avx2(const float* v, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(v + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(v + i + 8));
  }
  float s = vmath::hsum8(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += v[i];
  return s;
}
#endif

// The sum of n values (a squeeze-excite channel mean's numerator), in float32 as eager's mean.
float sum_of(const float* v, int64_t n) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2()) return sum_avx2(v, n);
#endif
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += v[i + j];
  for (; i < n; ++i) s[0] += v[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// After the project product was written with beta 0: output rows [o0, o1), columns [at, at + span) of
// yn's planes get their bias and the residual, in one pass while they are in cache (written first and
// added onto, they missed the cache in that pass instead: 4 % of MobileNetV2's samples).
void add_bias_residual(const Geometry& g, const Call& c, const float* rn, float* yn, int o0, int o1, int64_t at,
                       int64_t span) {
  if (!c.bp && !rn) return;
  for (int o = o0; o < o1; ++o) {
    float* dst = yn + o * g.P() + at;
    const float b = c.bp ? c.bp[o] : 0.f;
    const float* r = rn ? rn + o * g.P() + at : nullptr;
#ifdef MLXD_CPU_X86
    if (cpu_use_avx2()) {
      vmath::add_bias_residual_clamp(dst, span, b, r, -INFINITY, INFINITY);
      continue;
    }
#endif
    for (int64_t q = 0; q < span; ++q) dst[q] = dst[q] + b + (r ? r[q] : 0.f);
  }
}

// The expand's bias and whole activation over `channels` channels of n contiguous sgemm outputs
// each, in place, when the activation has a function after its clamp (its map then runs over the
// whole run, not per row of a few columns); the rows are then copied into the padded buffer.
// False: nothing done (a clamp alone is applied on the way into the padded rows).
bool expand_in_place(const BlockActivation& a, const float* bias, int channels, float* v, int64_t n) {
  if (a.act < 0) return false;
  for (int e = 0; e < channels; ++e) act_row(v + e * n, bias ? bias[e] : 0.f, a, static_cast<int>(n), v + e * n);
  act_map(a, v, channels * n);
  return true;
}

// Output rows [R0, R1) of image n.
void run_band(const Geometry& g, const Call& c, int n, int R0, int R1) {
  const int64_t Wp = padded_width(g), HW = int64_t{g.H} * g.W;
  const DwChannelFn dw_rows = dw_channel_fn(g);
  // The largest tile (output rows) whose buffers fit the budget; at least one row.
  auto bytes = [&](int t) {
    const int64_t cap = int64_t{t - 1} * g.sh + g.KH;
    return 4 * int64_t{g.E} * (cap * Wp + cap * g.W + int64_t{t} * g.OW);
  };
  int T = std::max(1, R1 - R0);
  while (T > 1 && bytes(T) > tile_budget()) T = std::max(1, T * 3 / 4);
  const int64_t cap = int64_t{T - 1} * g.sh + g.KH;  // padded input rows a tile holds
  Scratch& s = scratch();
  at_least(s.rows, (g.E * cap + int64_t{kDwBlockRows} * g.sh) * Wp);  // slack: the last channel's blocks read on
  at_least(s.gemm, g.expand ? g.E * cap * g.W : 0);
  at_least(s.dw, int64_t{g.E} * T * g.OW);
  float* buf = s.rows.data();
  const float* xn = c.x + int64_t{n} * g.C * HW;
  float* yn = c.y + int64_t{n} * g.O * g.P();
  const float* rn = c.res ? c.res + int64_t{n} * g.O * g.P() : nullptr;
  int held_lo = 0, held_hi = 0;  // padded rows in the buffer
  for (int r0 = R0; r0 < R1; r0 += T) {
    const int r1 = std::min(r0 + T, R1), count = r1 - r0;
    const int need_lo = r0 * g.sh, need_hi = (r1 - 1) * g.sh + g.KH;
    int keep = 0;
    if (held_hi > need_lo && held_lo <= need_lo) {  // rows the previous tile holds already
      keep = held_hi - need_lo;
      const int64_t shift = need_lo - held_lo;
      if (shift > 0)
        for (int e = 0; e < g.E; ++e) {
          float* be = buf + e * cap * Wp;
          std::memmove(be, be + shift * Wp, keep * Wp * sizeof(float));
        }
    }
    const int p0 = need_lo + keep;
    for (int p = p0; p < need_hi; ++p) {  // padding rows
      const int ih = p - g.ph;
      if (ih >= 0 && ih < g.H) continue;
      for (int e = 0; e < g.E; ++e) std::fill_n(buf + e * cap * Wp + int64_t{p - need_lo} * Wp, Wp, 0.f);
    }
    const int ih0 = std::max(p0 - g.ph, 0), ih1 = std::min(need_hi - g.ph, g.H);
    if (ih1 > ih0) {
      const int64_t cols = int64_t{ih1 - ih0} * g.W;
      if (g.expand)
        weight_gemm(c, c.pe, c.we, 0, g.E, g.C, static_cast<int>(cols), xn + int64_t{ih0} * g.W, static_cast<int>(HW),
                    0.f, s.gemm.data(), static_cast<int>(cols));
      const bool done = g.expand && expand_in_place(g.ea, c.be, g.E, s.gemm.data(), cols);
      for (int e = 0; e < g.E; ++e) {
        const float* src = g.expand ? s.gemm.data() + e * cols : xn + e * HW + int64_t{ih0} * g.W;
        fill_plane(src, ih1 - ih0, g.W, g.expand && !done, c.be ? c.be[e] : 0.f, g.ea,
                   buf + e * cap * Wp + int64_t{ih0 + g.ph - need_lo} * Wp, Wp, g.pw, true);
      }
    }
    held_lo = need_lo;
    held_hi = need_hi;
    const int64_t ldd = int64_t{T} * g.OW;
    for (int e = 0; e < g.E; ++e) {
      dw_rows(g, buf + e * cap * Wp, Wp, c.wd + int64_t{e} * g.KH * g.KW, c.bd ? c.bd[e] : 0.f, count,
                 s.dw.data() + e * ldd);
      act_map(g.da, s.dw.data() + e * ldd, int64_t{count} * g.OW);
    }
    // Output rows: the project product, then bias + residual.
    const int64_t span = int64_t{count} * g.OW, at = int64_t{r0} * g.OW;
    weight_gemm(c, c.pp, c.wp, 0, g.O, g.E, static_cast<int>(span), s.dw.data(), static_cast<int>(ldd), 0.f, yn + at,
                static_cast<int>(g.P()));
    add_bias_residual(g, c, rn, yn, 0, g.O, at, span);
  }
}

// A small map (the 14x14 and 7x7 stages), or any block with squeeze-excite, whole, over the pool:
// channel blocks of the expand and depthwise (each block's sgemm over the whole map, so the
// weights are read once and the products are wide enough), into one [E, OH * OW] buffer; then
// blocks of output channels of the project sgemm. Row bands there would be a few rows each,
// recomputing their borders and re-reading every weight per band. With squeeze-excite, each
// channel block also takes its channel means and its share of the reduce product (its columns
// of the weight), the calling thread adds the shares and applies the reduce activation, a second
// pass over channel blocks computes their gates (rows of the expand weight) and, when the map is
// smaller than the output channels, scales their depthwise rows; otherwise each project block
// folds the gate into its rows of the project weight (the smaller pass either way).
void run_channels(const Geometry& g, const Call& c) {
  const int64_t Wp = padded_width(g), HW = int64_t{g.H} * g.W, P = g.P();
  const DwChannelFn dw_rows = dw_channel_fn(g);
  const int64_t Hp = int64_t{g.OH - 1} * g.sh + g.KH;  // padded rows the depthwise reads
  // The depthwise output: channel rows of P, or (pixel-major form) pixel rows of ld channels, the buffer
  // first holding the expand's product over HW pixels.
  const bool pixels = pixel_major(g);
  if (pixels) cpu_kernel_note_call("inverted_residual_pixels");
  const int64_t ld = pixels ? pixel_ld(g.E) : P;
  std::vector<float>& dw = scratch().shared;  // the calling thread's: read by every part
  at_least(dw, pixels ? std::max(HW, P) * ld : int64_t{g.E} * P);
  auto at = [&](int e, int64_t p) { return dw.data() + (pixels ? p * ld + e : e * P + p); };
  const int threads = cpu_pool_threads();
  const int eparts = std::max(1, std::min(threads, g.E / (pixels ? kPixelGroup : 8)));
  const int oparts = std::max(1, std::min(threads, g.O / 8));
  // Squeeze-excite: channel means, then the gate; each channel block's share of the reduce product.
  std::vector<float> gate(g.S ? g.E : 0), shares(g.S ? int64_t{eparts} * g.S : 0), t(g.S);
  const bool scale_dw = g.S && P < g.O;  // E x P multiplies instead of O x E
  const float inv_p = 1.f / static_cast<float>(P);
  // Part `part` of `parts` of [0, total), cut at multiples of `align` (a pack's panels) where every
  // part still gets some; elsewhere the parts off a panel boundary run on the plain weight.
  auto range = [](int total, int parts, int part, int align, int fallback = 1) {
    if (total / parts < align) align = fallback;
    // Rounded to the nearest boundary: part 0, the calling thread's, starts first (36 / 72 rows: 40 / 32).
    auto cut = [&](int q) {
      return q == parts ? total : static_cast<int>(int64_t{total} * q / parts + align / 2) / align * align;
    };
    return std::make_pair(cut(part), cut(part + 1));
  };
  int e_align = c.pe ? serial_sgemm_pack_align(c.pe) : 1;
  const int o_align = c.pp ? serial_sgemm_pack_align(c.pp) : 1;
  if (pixels) e_align = std::lcm(e_align, kPixelGroup);  // parts of whole channel groups
  for (int n = 0; n < g.N; ++n) {
    const float* xn = c.x + int64_t{n} * g.C * HW;
    float* yn = c.y + int64_t{n} * g.O * P;
    const float* rn = c.res ? c.res + int64_t{n} * g.O * P : nullptr;
    cpu_parallel_parts(eparts, [&](int part) {
      const auto [e0, e1] = range(g.E, eparts, part, e_align, pixels ? kPixelGroup : 1);
      if (pixels) {
        weight_gemm_ct(c, c.pe, c.we + int64_t{e0} * g.C, e0, e1 - e0, g.C, static_cast<int>(HW), xn,
                       static_cast<int>(HW), dw.data() + e0, static_cast<int>(ld));
        pixels_part(g, dw.data(), ld, e0, e1, c.be, c.wd, c.taps, c.bd, g.S ? gate.data() : nullptr);
        if (g.S) {
          for (int e = e0; e < e1; ++e) gate[e] *= inv_p;
          dot_rows(c.wr + e0, g.E, g.S, e1 - e0, gate.data() + e0, shares.data() + int64_t{part} * g.S);
        }
        return;
      }
      Scratch& s = scratch();
      s.rows.assign((Hp + int64_t{kDwBlockRows} * g.sh) * Wp, 0.f);  // borders and slack stay zero
      bool done = false;  // the expand's activation applied in place
      if (g.expand) {
        at_least(s.gemm, int64_t{e1 - e0} * HW);
        weight_gemm(c, c.pe, c.we + int64_t{e0} * g.C, e0, e1 - e0, g.C, static_cast<int>(HW), xn, static_cast<int>(HW), 0.f, s.gemm.data(),
                    static_cast<int>(HW));
        done = expand_in_place(g.ea, c.be ? c.be + e0 : nullptr, e1 - e0, s.gemm.data(), HW);
      }
      const int rows = static_cast<int>(std::min<int64_t>(g.H, Hp - g.ph));
      for (int e = e0; e < e1; ++e) {
        const float* src = g.expand ? s.gemm.data() + int64_t{e - e0} * HW : xn + e * HW;
        fill_plane(src, rows, g.W, g.expand && !done, c.be ? c.be[e] : 0.f, g.ea,
                   s.rows.data() + int64_t{g.ph} * Wp, Wp, g.pw, false);
        dw_rows(g, s.rows.data(), Wp, c.wd + int64_t{e} * g.KH * g.KW, c.bd ? c.bd[e] : 0.f, g.OH, dw.data() + e * P);
      }
      act_map(g.da, dw.data() + e0 * P, (e1 - e0) * P);
      if (g.S) {
        for (int e = e0; e < e1; ++e) gate[e] = sum_of(dw.data() + e * P, P) * inv_p;
        dot_rows(c.wr + e0, g.E, g.S, e1 - e0, gate.data() + e0, shares.data() + int64_t{part} * g.S);
      }
    });
    if (g.S) {
      for (int i = 0; i < g.S; ++i) {
        float v = c.br ? c.br[i] : 0.f;
        for (int p = 0; p < eparts; ++p) v += shares[int64_t{p} * g.S + i];
        t[i] = activate(g.ra, v);
      }
      act_map(g.ra, t.data(), g.S);
      // Small gates (E x S under 32 K weights: the 28x28 and 56x56 stages) on the calling thread: a
      // hand-off to the pool would cost more than the product.
      const int gparts = int64_t{g.E} * g.S >= (1 << 15) ? eparts : 1;
      cpu_parallel_parts(gparts, [&](int part) {
        const auto [e0, e1] = range(g.E, gparts, part, 1);
        dot_rows(c.wx + int64_t{e0} * g.S, g.S, e1 - e0, g.S, t.data(), gate.data() + e0);
        for (int e = e0; e < e1; ++e) gate[e] = activate(g.xa, gate[e] + (c.bx ? c.bx[e] : 0.f));
        act_map(g.xa, gate.data() + e0, e1 - e0);
        if (scale_dw && pixels)
          for (int64_t q = 0; q < P; ++q) {
            float* row = at(0, q);
            for (int e = e0; e < e1; ++e) row[e] *= gate[e];
          }
        else if (scale_dw)
          for (int e = e0; e < e1; ++e) {
            float* row = at(e, 0);
            const float k = gate[e];
            for (int64_t q = 0; q < P; ++q) row[q] *= k;
          }
      });
    }
    // With the weight packed (and no gate folded into it), blocks of columns where the map is wide enough:
    // each thread then packs its own columns of the depthwise output, not all of them (MobileNetV2 / V3
    // at batch 1: 2-3 % in one process).
    if (c.pp && !(g.S && !scale_dw) && P >= 64 * oparts) {
      cpu_parallel_parts(oparts, [&](int part) {
        auto cut = [&](int q) { return q == oparts ? P : P * q / oparts / 16 * 16; };
        const int64_t j0 = cut(part), j1 = cut(part + 1);
        weight_gemm(c, c.pp, c.wp, 0, g.O, g.E, static_cast<int>(j1 - j0), at(0, j0), static_cast<int>(ld), 0.f,
                    yn + j0, static_cast<int>(P), pixels);
        add_bias_residual(g, c, rn, yn, 0, g.O, j0, j1 - j0);
      });
      continue;
    }
    cpu_parallel_parts(oparts, [&](int part) {
      // With the gate folded into the plain weight no pack serves the rows: equal parts, not panel-aligned
      // ones (16 / 24 of 40 rows).
      const bool fold = g.S && !scale_dw;
      const auto [o0, o1] = range(g.O, oparts, part, fold && !c.pp ? 1 : o_align);
      // The gate folded into this block's rows of the weight's pack, in one pass over them: folded into the
      // plain rows, the sgemm packed them again (MobileNetV3's 14x14 blocks: 4-6 % of their samples).
      if (fold && c.pp) {
        const float* pack = serial_sgemm_pack_scaled(c.pp, o0, o1 - o0, g.E, gate.data(), scratch().weights);
        if (pack && serial_sgemm_packed(pack, 0, o1 - o0, g.E, pixels, static_cast<int>(P), 1.f, dw.data(),
                                        static_cast<int>(ld), 0.f, yn + o0 * P, static_cast<int>(P))) {
          c.packed->store(true, std::memory_order_relaxed);
          add_bias_residual(g, c, rn, yn, o0, o1, 0, P);
          return;
        }
      }
      const float* w = c.wp + int64_t{o0} * g.E;
      if (fold) {  // the gate folded into this block's rows of the project weight
        std::vector<float>& ws = scratch().weights;
        at_least(ws, int64_t{o1 - o0} * g.E);
        for (int o = o0; o < o1; ++o) {
          const float* src = c.wp + int64_t{o} * g.E;
          float* dst = ws.data() + int64_t{o - o0} * g.E;
          for (int e = 0; e < g.E; ++e) dst[e] = src[e] * gate[e];
        }
        w = ws.data();
      }
      // The pack holds the plain weight: not where the gate was folded into it.
      weight_gemm(c, w == c.wp + int64_t{o0} * g.E ? c.pp : nullptr, w, o0, o1 - o0, g.E,
                  static_cast<int>(P), dw.data(), static_cast<int>(ld), 0.f, yn + o0 * P, static_cast<int>(P), pixels);
      add_bias_residual(g, c, rn, yn, o0, o1, 0, P);
    });
  }
}

void run_bands(const Geometry& g, const Call& c);

void run_block(const Geometry& g, const std::vector<mx::array>& in, const std::vector<int>& slot, void* out,
               mx::Dtype out_dtype) {
  std::vector<F32RowMajor> f32;
  f32.reserve(in.size());
  for (const auto& a : in) f32.emplace_back(a);
  auto at = [&](int i) { return slot[i] < 0 ? nullptr : f32[slot[i]].data(); };
  std::vector<float> ys;
  float* y = static_cast<float*>(out);
  if (out_dtype != mx::float32) {
    ys.resize(int64_t{g.N} * g.O * g.P());
    y = ys.data();
  }
  std::atomic<bool> packed{false};
  const Call c{at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11), y, at(12),
               at(13), at(14), &packed};
  if (g.S > 0 || int64_t{g.E} * g.H * g.W * 4 <= channel_split_limit()) {
    cpu_kernel_note_call("inverted_residual_channels");
    run_channels(g, c);
  } else {
    cpu_kernel_note_call("inverted_residual_rows");
    run_bands(g, c);
  }
  if (packed.load(std::memory_order_relaxed)) cpu_kernel_note_call("inverted_residual_packed_weights");
  if (out_dtype != mx::float32) cpu_store_f32(y, out_dtype, 0, static_cast<int64_t>(ys.size()), out);
}

void run_bands(const Geometry& g, const Call& c) {
  // One band per pool thread and image (an image alone fills the pool).
  const int bands = std::max(1, std::min(g.OH, (cpu_pool_threads() + g.N - 1) / g.N));
  cpu_parallel_parts(g.N * bands, [&](int part) {
    const int n = part / bands, b = part % bands;
    run_band(g, c, n, static_cast<int>(int64_t{g.OH} * b / bands), static_cast<int>(int64_t{g.OH} * (b + 1) / bands));
  });
}

const ChainableKernel kBlockCpuChainable{"BlockCpu"};  // kernel_chain.h

class BlockCpu : public mx::UnaryPrimitive {
 public:
  // slot: the input index of x, expand w / b, dw w / b, project w / b, residual, squeeze-excite
  // reduce w / b and expand w / b, the expand and project packs (-1: absent).
  BlockCpu(mx::Stream s, Geometry g, std::vector<int> slot) : mx::UnaryPrimitive(s), g_(g), slot_(std::move(slot)) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    Geometry g = g_;
    g.N = in[0].shape(0);
    cpu_kernel_note_call("inverted_residual");
    encoder.dispatch([g, in, slot = slot_, data = out.data<void>(), dtype = out.dtype()] {
      run_block(g, in, slot, data, dtype);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("BlockCpu runs on the CPU only");
  }
  const char* name() const override { return "BlockCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const BlockCpu&>(other);
    // The ints compared as one block (no padding among them), then the activations.
    auto same_act = [](const BlockActivation& a, const BlockActivation& b) {
      return a.act == b.act && a.lo == b.lo && a.hi == b.hi;
    };
    return std::memcmp(&g_, &o.g_, offsetof(Geometry, expand)) == 0 && g_.expand == o.g_.expand &&
           same_act(g_.ea, o.g_.ea) && same_act(g_.da, o.g_.da) && same_act(g_.ra, o.g_.ra) &&
           same_act(g_.xa, o.g_.xa) && slot_ == o.slot_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {{in[0].shape(0), g_.O, g_.OH, g_.OW}};
  }

 private:
  Geometry g_;
  std::vector<int> slot_;
};

std::string shape_str(const mx::array& a) {
  std::string s = "[";
  for (int i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("inverted_residual: " + what);
}

}  // namespace

std::pair<int64_t, int64_t> set_block_tiling(int64_t channels, int64_t tile) {
  std::pair<int64_t, int64_t> previous{channels_kb().load(), tile_kb().load()};
  if (channels >= 0) channels_kb().store(channels);
  if (tile > 0) tile_kb().store(tile);
  return previous;
}

bool block_cpu_applies(const BlockOperands& ops, const BlockParams& p) {
  if (!cpu_kernels_active() || serial_sgemm() == nullptr || !cpu_kernel_dtype_ok(ops.x)) return false;
  const auto t = ops.x.dtype();
  for (const auto* a : {&ops.expand_w, &ops.expand_b, &ops.dw_b, &ops.project_b, &ops.residual, &ops.se_reduce_w,
                        &ops.se_reduce_b, &ops.se_expand_w, &ops.se_expand_b})
    if (a->has_value() && (*a)->dtype() != t) return false;
  if (ops.dw_w.dtype() != t || ops.project_w.dtype() != t) return false;
  for (const auto* a : {&p.expand_act, &p.dw_act, &p.se_reduce_act, &p.se_expand_act})
    if (a->act > static_cast<int>(UnaryKernel::hardsigmoid)) return false;  // not a UnaryKernel
  if (ops.se_reduce_w && ops.se_reduce_w->size() == 0) return false;
  // Empty channel counts stay on the convolutions (an sgemm with K = 0 rejects its leading dimension).
  if (ops.dw_w.size() == 0 || ops.project_w.size() == 0 || (ops.expand_w && ops.expand_w->size() == 0)) return false;
  return ops.dw_w.ndim() == 4 && ops.dw_w.shape(2) * ops.dw_w.shape(3) <= kMaxTaps && ops.dw_w.shape(2) <= 7;
}

namespace {

// The block's geometry; throws std::invalid_argument on operands of mismatched shapes.
Geometry block_geometry(const BlockOperands& ops, const BlockParams& p) {
  const auto& x = ops.x;
  need(x.ndim() == 4, "x must be [N, C, H, W], got " + shape_str(x));
  const int C = x.shape(1), E = ops.expand_w ? ops.expand_w->shape(0) : C;
  if (ops.expand_w)
    need(ops.expand_w->ndim() == 4 && ops.expand_w->shape(1) == C && ops.expand_w->shape(2) == 1 &&
             ops.expand_w->shape(3) == 1,
         "expand weight " + shape_str(*ops.expand_w) + " is not [E, " + std::to_string(C) + ", 1, 1]");
  need(ops.dw_w.shape(0) == E && ops.dw_w.shape(1) == 1,
       "depthwise weight " + shape_str(ops.dw_w) + " is not [" + std::to_string(E) + ", 1, kh, kw]");
  const auto& pw = ops.project_w;
  need(pw.ndim() == 4 && pw.shape(1) == E && pw.shape(2) == 1 && pw.shape(3) == 1,
       "project weight " + shape_str(pw) + " is not [O, " + std::to_string(E) + ", 1, 1]");
  const int O = pw.shape(0);
  auto vec_of = [&](const std::optional<mx::array>& b, int size, const char* what) {
    if (b) need(b->size() == static_cast<size_t>(size), std::string(what) + " bias needs " + std::to_string(size) + " elements");
  };
  vec_of(ops.expand_w ? ops.expand_b : std::nullopt, E, "expand");
  need(ops.expand_w || !ops.expand_b, "an expand bias without an expand weight");
  vec_of(ops.dw_b, E, "depthwise");
  vec_of(ops.project_b, O, "project");
  need(ops.se_reduce_w.has_value() == ops.se_expand_w.has_value(), "squeeze-excite needs both its weights");
  int S = 0;
  if (ops.se_reduce_w) {
    const auto &wr = *ops.se_reduce_w, &wx = *ops.se_expand_w;
    S = wr.ndim() == 4 ? wr.shape(0) : 0;
    need(wr.ndim() == 4 && wr.shape(1) == E && wr.shape(2) == 1 && wr.shape(3) == 1,
         "squeeze-excite reduce weight " + shape_str(wr) + " is not [S, " + std::to_string(E) + ", 1, 1]");
    need(wx.ndim() == 4 && wx.shape(0) == E && wx.shape(1) == S && wx.shape(2) == 1 && wx.shape(3) == 1,
         "squeeze-excite expand weight " + shape_str(wx) + " is not [" + std::to_string(E) + ", " +
             std::to_string(S) + ", 1, 1]");
    vec_of(ops.se_reduce_b, S, "squeeze-excite reduce");
    vec_of(ops.se_expand_b, E, "squeeze-excite expand");
  } else {
    need(!ops.se_reduce_b && !ops.se_expand_b, "squeeze-excite biases without its weights");
  }
  const int KH = ops.dw_w.shape(2), KW = ops.dw_w.shape(3);
  need(std::min(p.sh, p.sw) >= 1 && std::min({p.ph, p.pw, p.ph_hi, p.pw_hi}) >= 0,
       "stride must be positive, padding non-negative");
  need(x.shape(2) + p.ph + p.ph_hi >= KH && x.shape(3) + p.pw + p.pw_hi >= KW,
       "the depthwise window is larger than the padded input");
  Geometry g{x.shape(0), C, x.shape(2), x.shape(3), E, O, KH, KW, 0, 0, p.sh, p.sw, p.ph, p.pw, S,
             ops.expand_w.has_value(), p.expand_act, p.dw_act, p.se_reduce_act, p.se_expand_act};
  g.OH = (g.H + p.ph + p.ph_hi - KH) / p.sh + 1;
  g.OW = (g.W + p.pw + p.pw_hi - KW) / p.sw + 1;
  if (ops.residual)
    need(ops.residual->shape() == mx::Shape({g.N, O, g.OH, g.OW}),
         "residual " + shape_str(*ops.residual) + " does not have the output's shape");
  return g;
}

}  // namespace

mx::array block_cpu(const BlockOperands& ops, const BlockParams& p) {
  if (!block_cpu_applies(ops, p)) throw std::invalid_argument("inverted_residual: operands the CPU kernel does not take");
  const auto& x = ops.x;
  const Geometry g = block_geometry(ops, p);
  const int O = g.O;
  std::vector<mx::array> inputs{x};
  std::vector<int> slot(15, -1);
  slot[0] = 0;
  auto add = [&](int i, const std::optional<mx::array>& a) {
    if (!a) return;
    slot[i] = static_cast<int>(inputs.size());
    inputs.push_back(*a);
  };
  add(1, ops.expand_w);
  add(2, ops.expand_b);
  add(3, ops.dw_w);
  add(4, ops.dw_b);
  add(5, ops.project_w);
  add(6, ops.project_b);
  add(7, ops.residual);
  add(8, ops.se_reduce_w);
  add(9, ops.se_reduce_b);
  add(10, ops.se_expand_w);
  add(11, ops.se_expand_b);
  // Packs of other shapes than [1, floats] (none: the products run on MKL) are left out.
  auto pack = [](const std::optional<mx::array>& a) {
    return a && a->dtype() == mx::float32 && a->ndim() == 2 && a->shape(0) == 1 && a->size() > 0 ? a : std::nullopt;
  };
  add(12, ops.expand_w ? pack(ops.expand_pack) : std::nullopt);
  add(13, pack(ops.project_pack));
  add(14, ops.dw_taps && ops.dw_taps->dtype() == mx::float32 &&
                  ops.dw_taps->shape() == mx::Shape({g.KH * g.KW, static_cast<int>(pixel_ld(g.E))})
              ? ops.dw_taps
              : std::nullopt);
  auto prim = std::make_shared<BlockCpu>(mx::default_stream(mx::Device::cpu), g, slot);
  return mx::array({g.N, O, g.OH, g.OW}, x.dtype(), std::move(prim), std::move(inputs));
}

bool block_uses_taps(const BlockOperands& ops, const BlockParams& p) {
  if (!block_cpu_applies(ops, p)) return false;
  try {
    const Geometry g = block_geometry(ops, p);
    return (g.S > 0 || int64_t{g.E} * g.H * g.W * 4 <= channel_split_limit()) && pixel_major_fits(g);
  } catch (const std::invalid_argument&) {
    return false;  // block_cpu reports it
  }
}

mx::array block_dw_taps(const mx::array& dw_w) {
  const int E = dw_w.shape(0), T = dw_w.shape(2) * dw_w.shape(3), L = static_cast<int>(pixel_ld(E));
  auto t = mx::transpose(mx::reshape(mx::astype(dw_w, mx::float32), {E, T}));
  if (L > E) t = mx::pad(t, {{0, 0}, {0, L - E}});
  return mx::contiguous(t);
}

std::optional<SgemmPackHints> block_pack_hints(const BlockOperands& ops, const BlockParams& p, bool project) {
  if (!block_cpu_applies(ops, p) || (!project && !ops.expand_w)) return std::nullopt;
  Geometry g;
  try {
    g = block_geometry(ops, p);
  } catch (const std::invalid_argument&) {
    return std::nullopt;  // block_cpu reports it
  }
  const int threads = cpu_pool_threads();
  const int64_t HW = int64_t{g.H} * g.W, P = g.P();
  if (g.S > 0 || int64_t{g.E} * HW * 4 <= channel_split_limit()) {  // run_channels' products
    const int parts = std::max(1, std::min(threads, (project ? g.O : g.E) / 8));
    // The pixel-major form's expand is written across, pixel by pixel (weight_gemm_ct).
    const bool across = !project && pixel_major(g);
    return SgemmPackHints{(project ? g.O : g.E) / parts, static_cast<int>(project ? P : HW), across};
  }
  const int bands = std::max(1, std::min(g.OH, (threads + g.N - 1) / g.N));  // run_bands' (tiles of a band)
  return SgemmPackHints{project ? g.O : g.E, static_cast<int>((project ? P : HW) / bands)};
}

}  // namespace mlxd::rt
