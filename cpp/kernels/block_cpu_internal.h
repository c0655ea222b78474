// Pieces the inverted-residual block's files share (block_cpu.cpp: the block's schedule and its
// products; block_depthwise_cpu.cpp: the padded planes and the depthwise rows read from them).
// Internal to the kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/block_cpu.h"
#include "kernels/cpu_parallel.h"

namespace mlxd::rt::block_detail {

constexpr int kMaxTaps = 49;  // 7x7 windows at most (MobileNet / EfficientNet use 3x3 and 5x5)
// Output rows a depthwise block covers at most: the rows it reads past a tile's last (the slack after
// each buffer of padded rows; computed, never stored). Eight on maps of up to eight columns (one vector
// a row: eight independent accumulators), four or two on wider ones.
constexpr int kDwBlockRows = 8;

struct Geometry {
  int N, C, H, W, E, O, KH, KW, OH, OW, sh, sw, ph, pw, S;  // S: squeeze-excite channels (0: none)
  bool expand;
  BlockActivation ea, da, ra, xa;  // expand, depthwise, squeeze-excite reduce and expand
  int64_t P() const { return int64_t{OH} * OW; }
};


// The clamp part of an activation (the function after it runs as a map over whole runs);
// std::max / min keep a NaN as torch's clamp does.
inline float activate(const BlockActivation& a, float v) { return std::min(std::max(v, a.lo), a.hi); }

// Columns of a padded row (Wp): the input's pw + W, and every read of the depthwise vector loops, which
// compute whole vectors of sixteen outputs (the stride-2 loads read up to 2 x 16 columns each).
int padded_width(const Geometry& g);

// The depthwise rows of one channel, output rows [0, count), from its padded rows (buf, row stride Wp),
// with the clamp of its activation (the caller maps the rest over whole runs of channels).
using DwChannelFn = void (*)(const Geometry& g, const float* buf, int64_t Wp, const float* k, float bias, int count,
                             float* out);
// The instance for g (instruction set, width stride, window, map width), resolved once per call.
DwChannelFn dw_channel_fn(const Geometry& g);

// dst[i] = clamp(src[i] + b), i < n.
void act_row(const float* src, float b, const BlockActivation& a, int n, float* dst);

// rows x W values of one channel (row stride W) into padded rows of stride Wp from dst, at column pw:
// clamp(v + b) when `act`, else copied; columns [0, pw) and [pw + W, Wp) zeroed when `borders`. One call
// per channel: per-row calls cost more than a 7- or 14-column row itself.
void fill_plane(const float* src, int rows, int W, bool act, float b, const BlockActivation& a, float* dst,
                int64_t Wp, int pw, bool borders);

// The pixel-major form (block_pixels_cpu.cpp): small maps with an expand and activations it computes
// in its vectors. Groups of kPixelGroup channels; pixel rows of pixel_ld(E) floats.
constexpr int kPixelGroup = 16;
int64_t pixel_ld(int E);
// Whether g fits the form; pixel_major: and it is not switched off (MLX_DELEGATE_BLOCK_PIXELS=0, read at
// each call).
bool pixel_major_fits(const Geometry& g);
bool pixel_major(const Geometry& g);
// Channels [e0, e1) (e0 a multiple of kPixelGroup): d [max(HW, P), ld] holds the expand's product, pixel by
// pixel, on entry, and its first P rows the depthwise output (biases and activations applied) on exit.
// taps: the depthwise weight [KH * KW, pixel_ld(E)] (dw_taps_layout), or null (gathered from wd [E, KH *
// KW]). sums (non-null): the output's channel sums, at [e0, e1).
void pixels_part(const Geometry& g, float* d, int64_t ld, int e0, int e1, const float* be, const float* wd,
                 const float* taps, const float* bd, float* sums);

}  // namespace mlxd::rt::block_detail
