// A MobileNet-style inverted-residual block (1x1 expand + bias + activation ->
// depthwise + bias + activation -> 1x1 project + bias + residual) on the CPU as
// one MLX primitive, on torch's channels-first layout. Run convolution by
// convolution, the expanded activation (6x the block's channels) goes to memory
// and back twice per block; here small maps (the expanded activation within
// set_block_tiling's channel limit) run whole, split over channel blocks, and
// on larger ones each thread takes a band of output rows and walks it in
// tiles small enough to stay in its core's cache: the expand sgemm
// fills the tile's input rows (rows shared with the previous tile are kept, not
// recomputed), the depthwise loop reads them from a zero-bordered buffer, and
// the project sgemm writes the tile's output rows in place. The smallest maps
// (14x14, 7x7) run pixel by pixel: the depthwise then takes sixteen channels
// per vector where a channel's row filled 7 of 8 lanes. A block with
// squeeze-excite always runs whole (the gate needs every depthwise output
// before the project): the channel means are summed as the depthwise writes
// each channel, and the gate is folded into the project's weights.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include <mlx/mlx.h>

#include "kernels/cpu_parallel.h"

namespace mlxd::rt {

// A stage's activation: the clamp to [lo, hi] (ReLU, ReLU6; -inf / inf: none),
// then `act` (a UnaryKernel: hard-swish, hard-sigmoid, SiLU, ...; -1: none).
struct BlockActivation {
  float lo = -std::numeric_limits<float>::infinity(), hi = std::numeric_limits<float>::infinity();
  int act = -1;
};

struct BlockOperands {
  mlx::core::array x;                                  // [N, C, H, W]
  std::optional<mlx::core::array> expand_w, expand_b;  // [E, C, 1, 1], [E]; absent: the depthwise reads x (E = C)
  mlx::core::array dw_w;                               // [E, 1, KH, KW]
  std::optional<mlx::core::array> dw_b;                // [E]
  mlx::core::array project_w;                          // [O, E, 1, 1]
  std::optional<mlx::core::array> project_b;           // [O]
  std::optional<mlx::core::array> residual;            // [N, O, OH, OW]
  // Squeeze-excite (both weights or neither): the depthwise output's channel means -> reduce [S, E, 1, 1]
  // + bias + act -> expand [E, S, 1, 1] + bias + act: the gate multiplying the project's input.
  std::optional<mlx::core::array> se_reduce_w = std::nullopt, se_reduce_b = std::nullopt;
  std::optional<mlx::core::array> se_expand_w = std::nullopt, se_expand_b = std::nullopt;
  // The expand / project weights laid out once for the serial sgemm's tile (conv_pack_weights with
  // block_pack_hints' hints; a constant's), used where they fit: the products skip packing them.
  std::optional<mlx::core::array> expand_pack = std::nullopt, project_pack = std::nullopt;
  // The depthwise weight tap by tap (block_dw_taps; a constant's, laid out once) where block_uses_taps.
  std::optional<mlx::core::array> dw_taps = std::nullopt;
};

struct BlockParams {
  int sh = 1, sw = 1, ph = 0, pw = 0, ph_hi = 0, pw_hi = 0;  // the depthwise's stride and padding
  BlockActivation expand_act, dw_act, se_reduce_act, se_expand_act;
};

// Whether block_cpu takes these: kernels on (cpu_kernels_active), the serial
// sgemm found, every operand of x's dtype (float32 / bfloat16 / float16)
// and a depthwise window of at most 7x7. Shapes are
// the caller's to check (block_cpu throws std::invalid_argument on a mismatch).
bool block_cpu_applies(const BlockOperands& ops, const BlockParams& p);

// The kernel's size limits in KiB, returning the previous (channels, tile):
// maps whose expanded activation (E x H x W floats) takes at most `channels`
// run whole, split over channel blocks (0: never); larger ones in row bands
// walked in tiles whose buffers take at most `tile` per thread. A negative
// `channels` / non-positive `tile` keeps that one. For A/B runs and tests.
std::pair<int64_t, int64_t> set_block_tiling(int64_t channels, int64_t tile);

// The rows and columns of the expand's (project's) products for this input, the hints its pack is
// made for (conv_pack_weights(w, 1, hints)); std::nullopt where block_cpu would not run it on a
// constant weight's pack (no expand). A squeeze-excite gate folded into the project weight per call scales
// the pack's rows (serial_sgemm_pack_scaled).
std::optional<SgemmPackHints> block_pack_hints(const BlockOperands& ops, const BlockParams& p, bool project);

// Whether block_cpu runs these in its pixel-major form (small maps), which reads the depthwise weight
// tap by tap: block_dw_taps(dw_w), [KH * KW, E rounded up to 16] float32, zero past E.
bool block_uses_taps(const BlockOperands& ops, const BlockParams& p);
mlx::core::array block_dw_taps(const mlx::core::array& dw_w);

// The block's output [N, O, OH, OW] in x's dtype; math in float32 (the
// expanded and depthwise activations are not rounded to x's dtype in between).
mlx::core::array block_cpu(const BlockOperands& ops, const BlockParams& p);

}  // namespace mlxd::rt
