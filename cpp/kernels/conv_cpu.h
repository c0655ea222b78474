// 1-D / 2-D convolution on the CPU as one MLX primitive, on torch's
// channels-first layout. MLX's CPU convolution works channels-last, so the
// delegate transposed the input, the weight and the result on every call, and
// MLX runs grouped and depthwise convolutions through a scalar loop. This
// kernel reads NCHW and the weight as torch stores it ([O, C/g, kh, kw]):
// per image and group, im2col (none for a 1x1 stride-1 unpadded convolution)
// then one sgemm (the BLAS front MLX's matmul uses: torch's MKL), which writes
// the NCHW result directly; depthwise convolutions run a direct per-channel
// loop. Bias is added in the same pass. Math in float32.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include <mlx/mlx.h>

#include "kernels/cpu_parallel.h"
#include "kernels/unary_cpu.h"

namespace mlxd::rt {

// Whether conv_cpu takes these: kernels on (cpu_kernels_active), an sgemm
// found, x [N, C, (H,) W] and w [O, C/groups, (kh,) kw] of the same float32 /
// bfloat16 / float16 dtype, non-empty, and a bias (when given) of O elements.
// A residual and an input scale (when given) of x's dtype; their shapes are
// checked by conv_cpu.
bool conv_cpu_applies(const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array* bias,
                      int groups, const mlx::core::array* residual = nullptr,
                      const mlx::core::array* in_scale = nullptr);

// torch.nn.functional.conv{1,2}d(x, w, bias, stride, padding, dilation,
// groups); parameters have one entry per spatial axis, `padding` on the low
// side and `padding_hi` (empty: the same) on the high side. `residual` (the
// result's shape) is added and then `clamp` (lo, hi) applied in the passes
// that write the result (a fused residual add, ReLU / ReLU6), then `act` (a
// fused hard-swish, SiLU, ...) on the same results while they are in cache.
// `in_scale` ([N, C], N * C elements) multiplies the input per image and
// channel first (a squeeze-excite gate), folded into the weights or the input
// inside the kernel. `winograd_w`: w already transformed by winograd_weights
// (a constant's, made once), used when the Winograd path runs with that tile
// (kernels/winograd_cpu.h: 3x3 stride-1 convolutions, set_conv_winograd);
// without it that path transforms w on each call. The result has x's dtype.
// The tiled paths on or off from the next call on (A/B runs, parity tests of
// the whole-image path): large products in tiles of output rows (im2col and
// sgemm per tile, one tile per thread, in cache), smaller one-image products in
// blocks of output channels (bias, sgemm and clamp per block in one task),
// and depthwise convolutions as vector rows over a zero-bordered copy of each
// plane (off: a portable row-by-row loop). MLX_DELEGATE_CONV_TILES=0 starts
// with them off.
void set_conv_tiles(bool on);
bool conv_tiles();

// The direct path for convolutions of up to four input channels (a stem: conv_direct_cpu.cpp) on or
// off from the next call on (A/B runs, parity tests against the im2col path); MLX_DELEGATE_CONV_DIRECT=0
// starts with it off.
void set_conv_direct(bool on);
bool conv_direct();

mlx::core::array conv_cpu(const mlx::core::array& x, const mlx::core::array& w,
                          const std::optional<mlx::core::array>& bias, const std::vector<int>& stride,
                          const std::vector<int>& padding, const std::vector<int>& dilation, int groups,
                          std::optional<std::pair<float, float>> clamp = std::nullopt,
                          const std::vector<int>& padding_hi = {},
                          const std::optional<mlx::core::array>& residual = std::nullopt,
                          std::optional<UnaryKernel> act = std::nullopt,
                          const std::optional<mlx::core::array>& in_scale = std::nullopt,
                          const std::optional<mlx::core::array>& winograd_w = std::nullopt,
                          const std::optional<mlx::core::array>& packed_w = std::nullopt);

// The weights laid out once (a constant's: ExecContext::derived_constant) in the panels the serial
// sgemm's own tile reads, for the per-image products (bands of output rows, blocks of output
// channels), which then skip packing them on each call: conv_cpu's `packed_w`. conv_pack_hints: the
// rows and columns those products will have for this input, or std::nullopt where conv_cpu would
// not run them (Winograd, depthwise, images sharing one product, an input scale, the tiled paths off).
// conv_pack_weights: one pack per group ([groups, floats]); empty ([groups, 0]) where the products run on
// MKL. Costs a copy of the weights. With `winograd_w`, packed_w is winograd_packed_weights' instead.
std::optional<SgemmPackHints> conv_pack_hints(const mlx::core::array& x, const mlx::core::array& w,
                                                   const std::vector<int>& stride, const std::vector<int>& padding,
                                                   const std::vector<int>& padding_hi,
                                                   const std::vector<int>& dilation, int groups, bool has_in_scale);
mlx::core::array conv_pack_weights(const mlx::core::array& w, int groups, SgemmPackHints hints);

}  // namespace mlxd::rt
