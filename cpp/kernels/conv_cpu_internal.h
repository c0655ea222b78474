// Pieces the CPU convolution's files share (conv_cpu.cpp: the im2col / sgemm paths;
// conv_depthwise_cpu.cpp: one input channel per group). Internal to the kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "kernels/unary_cpu.h"

namespace mlxd::rt::conv_detail {

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
inline std::pair<int, int> valid_range(int out, int in, int s, int p, int k) {
  // ow * s >= p - k  and  ow * s <= in - 1 + p - k
  int lo_num = p - k, hi_num = in - 1 + p - k;
  int lo = lo_num <= 0 ? 0 : (lo_num + s - 1) / s;
  int hi = hi_num < 0 ? 0 : hi_num / s + 1;
  return {std::min(lo, out), std::clamp(hi, std::min(lo, out), out)};
}

inline void clamp_range(const Geometry& g, float* y, int64_t n) {
  if (!g.clamp) return;
  for (int64_t i = 0; i < n; ++i) y[i] = std::min(std::max(y[i], g.lo), g.hi);
}

// The fused activation (hard-swish, SiLU, ...) over n results still in cache.
inline void activate(const Geometry& g, float* y, int64_t n) {
  if (g.act >= 0) unary_cpu_map(static_cast<UnaryKernel>(g.act))(y, y, n);
}

inline bool has_epilogue(const Geometry& g) { return g.clamp || g.act >= 0; }

// The clamp, then the activation: the epilogue of every path.
inline void finish(const Geometry& g, float* y, int64_t n) {
  clamp_range(g, y, n);
  activate(g, y, n);
}

// The output plane's starting values: the bias, plus the residual's plane when there is one.
inline void init_plane(const Geometry& g, float* out, float bias, const float* residual) {
  if (residual) {
    for (int64_t i = 0; i < g.P(); ++i) out[i] = residual[i] + bias;
  } else {
    std::fill(out, out + g.P(), bias);
  }
}

// After a product written with beta 0: `rows` rows of `count` results (row stride ld) get their
// output channel's bias (bias[r], when given), the residual at the same positions (when given), the
// clamp and the activation, in one pass while they are in cache.
void finish_rows(const Geometry& g, float* y, int64_t ld, int rows, int64_t count, const float* bias,
                 const float* residual);

// The direct path for few input channels (conv_direct_cpu.cpp): whether it takes this convolution
// (w_image: per-image weights, which it does not take), and the convolution itself, bias, residual and
// epilogue included, into y (NCHW).
bool direct_applies(const Geometry& g, int64_t w_image);
void direct(const Geometry& g, const float* x, const float* w, const float* bias, const float* residual, float* y);

// One output plane per (image, channel) of a convolution with one input channel per group; w_image:
// the stride between per-image weight copies (0: one set shared).
void depthwise(const Geometry& g, const float* x, const float* w, int64_t w_image, const float* bias,
               const float* residual, float* y);

}  // namespace mlxd::rt::conv_detail
