// The inverted-residual block's expand + depthwise in pixel-major form, for small maps (block_cpu.cpp's
// run_channels): the expand's product is written pixel by pixel ([HW, E], channels contiguous: the
// layout its transposed tiles produce anyway), so the depthwise takes sixteen channels per vector at
// every pixel. Channel by channel, a 7x7 map's rows filled 7 of 8 lanes and a 14x14 map's 14 of 16,
// each channel a short loop of its own. The project then reads the output as its transposed operand.
//
// Per group of sixteen channels: the expand's bias and activation are applied while its pixels are
// copied into a zero-bordered plane [Hp][Wp][16] (a thread's, in L1 or L2), the depthwise reads that plane
// for Q output pixels of a row at a time (Q independent accumulators) and writes its output over the
// group's columns of the product, with its bias and activation, then the squeeze-excite channel sums.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/block_cpu_internal.h"
#include "kernels/cpu_parallel.h"
#include "kernels/unary_cpu.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt::block_detail {
namespace {

constexpr int kLanes = kPixelGroup;
typedef float V16 __attribute__((vector_size(kLanes * sizeof(float))));
typedef int I16 __attribute__((vector_size(kLanes * sizeof(int))));
typedef float V8 __attribute__((vector_size(8 * sizeof(float))));
typedef double D8 __attribute__((vector_size(8 * sizeof(double))));
constexpr int kMaxRun = 8;  // output pixels per register block at most (the plane's columns allow for it)

#define MLXD_INLINE __attribute__((always_inline)) inline

MLXD_INLINE V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
MLXD_INLINE void store16(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }
MLXD_INLINE V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
MLXD_INLINE V16 splat(float v) { return V16{} + v; }

// std::min(std::max(v, lo), hi) per lane: a NaN stays, as activate() keeps it.
MLXD_INLINE V16 clamp16(V16 v, V16 lo, V16 hi) {
  v = v < lo ? lo : v;
  return hi < v ? hi : v;
}

// The function after an activation's clamp, for the kinds vector_act takes (none, hard-swish). A
// multiply by 1/6 where unary_cpu's map divides by 6 (within an ulp of it): the divisions took a third
// of the pass.
MLXD_INLINE V16 act16(int act, V16 x) {
  if (act < 0) return x;
  V16 r = x + 3.f;
  r = r < 0.f ? splat(0.f) : r;
  r = 6.f < r ? splat(6.f) : r;
  return x * r * (1.f / 6.f);
}

// The blocks' stage activations: clamps (ReLU, ReLU6) and hard-swish (MobileNetV3); SiLU / GELU stages
// keep the channel-major form, whose maps run over whole channel runs.
bool vector_act(const BlockActivation& a) { return a.act < 0 || a.act == static_cast<int>(UnaryKernel::hardswish); }

// The plane's rows and columns: the input at (ph, pw) with zero borders, and every column a run of
// kMaxRun output pixels reads.
int64_t plane_rows(const Geometry& g) { return std::max(g.ph + g.H, (g.OH - 1) * g.sh + g.KH); }
int64_t plane_cols(const Geometry& g) {
  return std::max(g.pw + g.W, ((g.OW + kMaxRun - 1) / kMaxRun * kMaxRun - 1) * g.sw + g.KW);
}

// Q output pixels of one row from `top` (the plane at their first input pixel; `row`: floats per
// plane row), n of them stored at out (row stride ld).
template <int Q>
MLXD_INLINE void dw_run(const Geometry& g, const float* top, int64_t row, int ki0, int ki1, const float* w,
                        int64_t ws, V16 bias, V16 lo, V16 hi, float* out, int64_t ld, int n) {
  const int64_t step = int64_t{g.sw} * kLanes;
  V16 acc[Q];
  for (int i = 0; i < Q; ++i) acc[i] = bias;
  for (int ki = ki0; ki < ki1; ++ki)
    for (int kj = 0; kj < g.KW; ++kj) {
      const V16 wv = load16(w + (ki * g.KW + kj) * ws);
      const float* p = top + ki * row + kj * kLanes;
#pragma GCC unroll 8
      for (int i = 0; i < Q; ++i) acc[i] += wv * load16(p + i * step);
    }
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    if (i < n) store16(out + i * ld, act16(g.da.act, clamp16(acc[i], lo, hi)));
}

// One group: the plane from the product's columns [c, c + 16) (n valid), the depthwise over it into
// the same columns, and (sums non-null) the output's channel sums.
template <int Q>
MLXD_INLINE void group_impl(const Geometry& g, float* d, int64_t ld, int c, int n, const float* eb, const float* w,
                            int64_t ws, const float* db, float* plane, float* sums) {
  const int64_t Wp = plane_cols(g), row = Wp * kLanes;
  const I16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const I16 valid = lane < n;
  const V16 zero = splat(0.f), b_e = load16(eb), elo = splat(g.ea.lo), ehi = splat(g.ea.hi);
  for (int ih = 0; ih < g.H; ++ih) {
    const float* src = d + int64_t{ih} * g.W * ld + c;
    float* dst = plane + (int64_t{ih + g.ph} * Wp + g.pw) * kLanes;
    for (int iw = 0; iw < g.W; ++iw) {
      const V16 v = act16(g.ea.act, clamp16(load16(src + iw * ld) + b_e, elo, ehi));
      store16(dst + iw * kLanes, valid ? v : zero);  // lanes past E: zero, not the buffer's leftovers
    }
  }
  const V16 bias = load16(db), lo = splat(g.da.lo), hi = splat(g.da.hi);
  for (int oh = 0; oh < g.OH; ++oh) {
    const float* top = plane + int64_t{oh} * g.sh * row;
    // Window rows on the zero border add nothing: a 7x7 map's 5x5 windows read 29 of 35 rows.
    const int first = oh * g.sh - g.ph, ki0 = std::max(0, -first), ki1 = std::min(g.KH, g.H - first);
    for (int ow = 0; ow < g.OW; ow += Q)
      dw_run<Q>(g, top + int64_t{ow} * g.sw * kLanes, row, ki0, ki1, w, ws, bias, lo, hi,
                d + (int64_t{oh} * g.OW + ow) * ld + c, ld, std::min(Q, g.OW - ow));
  }
  if (!sums) return;
  // In float64: one running float32 sum per channel over 196 pixels lost digits that eager's pairwise mean
  // keeps, and the gate passed the difference on (max |err| 8x eager's own on MobileNetV3's 14x14 blocks).
  D8 lo8{}, hi8{};
  for (int64_t p = 0; p < g.P(); ++p) {
    lo8 += __builtin_convertvector(load8(d + p * ld + c), D8);
    hi8 += __builtin_convertvector(load8(d + p * ld + c + 8), D8);
  }
  for (int i = 0; i < n; ++i) sums[i] = static_cast<float>(i < 8 ? lo8[i] : hi8[i - 8]);
}

// The instances: eight pixels a block on sixteen-lane registers (seven on rows of 7 or 14, which eight
// would pad by one in eight), four where a vector is two (AVX2) or four (SSE, NEON) registers.
#ifdef MLXD_CPU_X86
MLXD_AVX512 void group_avx512(const Geometry& g, float* d, int64_t ld, int c, int n, const float* eb, const float* w,
                              int64_t ws, const float* db, float* plane, float* sums) {
  group_impl<8>(g, d, ld, c, n, eb, w, ws, db, plane, sums);
}
MLXD_AVX512 void group_avx512_7(const Geometry& g, float* d, int64_t ld, int c, int n, const float* eb,
                                const float* w, int64_t ws, const float* db, float* plane, float* sums) {
  group_impl<7>(g, d, ld, c, n, eb, w, ws, db, plane, sums);
}
MLXD_AVX2 void group_avx2(const Geometry& g, float* d, int64_t ld, int c, int n, const float* eb, const float* w,
                          int64_t ws, const float* db, float* plane, float* sums) {
  group_impl<4>(g, d, ld, c, n, eb, w, ws, db, plane, sums);
}
#endif
void group_portable(const Geometry& g, float* d, int64_t ld, int c, int n, const float* eb, const float* w,
                    int64_t ws, const float* db, float* plane, float* sums) {
  group_impl<4>(g, d, ld, c, n, eb, w, ws, db, plane, sums);
}

using GroupFn = void (*)(const Geometry&, float*, int64_t, int, int, const float*, const float*, int64_t,
                         const float*, float*, float*);
GroupFn group_fn(const Geometry& g) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx512()) return g.OW % 7 == 0 ? group_avx512_7 : group_avx512;
  if (cpu_use_avx2()) return group_avx2;
#endif
  return group_portable;
}

struct PlaneScratch {
  std::vector<float> plane;
  std::vector<float> taps;  // a group's weight gathered, [KH * KW][16] (no load-time layout)
};
PlaneScratch& plane_scratch() {
  thread_local PlaneScratch s;
  return s;
}

}  // namespace

int64_t pixel_ld(int E) { return (int64_t{E} + kLanes - 1) / kLanes * kLanes; }

// Planes of up to 64 KiB (L2, not L1) take the stride-2 blocks from 28x28 maps too (a 29 x 33 plane, 61 KiB):
// MobileNetV3-Large's features[7] alone 369.9 -> 332.7 us (best of 20 rounds, paired), the whole net 3879
// -> 3700 us (median of 16; XNNPACK 3080), MobileNetV2 level. Stride-1 28x28 planes (65-74 KiB) stay
// channel by channel.
bool pixel_major_fits(const Geometry& g) {
  const int64_t plane_bytes = plane_rows(g) * plane_cols(g) * kLanes * 4;
  return g.expand && g.P() <= 256 && int64_t{g.H} * g.W <= 1024 && plane_bytes <= (64 << 10) && vector_act(g.ea) &&
         vector_act(g.da);
}

bool pixel_major(const Geometry& g) {
  const char* off = std::getenv("MLX_DELEGATE_BLOCK_PIXELS");  // read at each call: A/B runs in one process
  return pixel_major_fits(g) && !(off && std::strcmp(off, "0") == 0);
}

void pixels_part(const Geometry& g, float* d, int64_t ld, int e0, int e1, const float* be, const float* wd,
                 const float* taps, const float* bd, float* sums) {
  PlaneScratch& s = plane_scratch();
  s.plane.assign(plane_rows(g) * plane_cols(g) * kLanes + kLanes, 0.f);  // the borders stay zero across groups
  // On a 64-byte boundary: each pixel's sixteen channels one cache line, not two (~1 % of a 14x14 block).
  float* plane = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.plane.data()) + 63) & ~uintptr_t{63});
  const int T = g.KH * g.KW;
  at_least(s.taps, int64_t{T} * kLanes);
  const GroupFn run = group_fn(g);
  for (int c = e0; c < e1; c += kLanes) {
    const int n = std::min(kLanes, e1 - c);
    alignas(64) float eb[kLanes] = {}, db[kLanes] = {};
    for (int i = 0; i < n; ++i) {
      eb[i] = be ? be[c + i] : 0.f;
      db[i] = bd ? bd[c + i] : 0.f;
    }
    // The group's weight tap by tap: read in place from the load-time layout, else gathered.
    const float* w = taps ? taps + c : s.taps.data();
    const int64_t ws = taps ? pixel_ld(g.E) : kLanes;
    if (!taps) {
      std::fill(s.taps.begin(), s.taps.end(), 0.f);
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < n; ++i) s.taps[int64_t{t} * kLanes + i] = wd[int64_t{c + i} * T + t];
    }
    run(g, d, ld, c, n, eb, w, ws, db, plane, sums ? sums + c : nullptr);
  }
}

}  // namespace mlxd::rt::block_detail
