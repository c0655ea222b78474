// Winograd F(m x m, 3 x 3) convolution on the CPU (m = 2 or 4), for
// conv_cpu's 3x3, stride-1, undilated, ungrouped float convolutions: each
// (m + 2)^2 input tile is transformed (B^T d B), the (m + 2)^2 element-wise
// products over the channels are (m + 2)^2 sgemms [O x C] x [C x tiles] against
// the weights transformed once (G g G^T), and each tile's products are
// transformed back (A^T M A) into an m x m output block, with the
// convolution's epilogue (bias, residual, clamp, activation) in the same pass.
// F(2x2) does 16 multiplies per 4 outputs where the direct convolution does 36
// (2.25x fewer), F(4x4) 36 per 16 (4x fewer), at the cost of the transforms'
// memory traffic and a larger rounding error. Works on torch's NCHW layout;
// math in float32. Internal to cpp/kernels/ (conv_cpu.cpp calls it).
#pragma once

#include <cstdint>
#include <vector>

#include <mlx/mlx.h>

namespace mlxd::rt {

// What the Winograd kernel needs of the convolution: stride 1, dilation 1,
// groups 1, a 3x3 kernel; padding on the low side (ph, pw: the high side only
// sets OH / OW, reads past the input are zeros).
struct WinogradGeometry {
  int N, C, H, W, O, OH, OW, ph, pw;
  bool clamp;
  float lo, hi;
  int act;  // a UnaryKernel applied after the clamp, -1: none
};

// The process-wide choice (read on every call, so one program can be timed
// both ways): 0 off (im2col + sgemm), 1 where the measured gate says it wins
// (the default), 2 / 4 F(2x2) / F(4x4) on every shape the kernel takes (tests,
// per-layer measurements). MLX_DELEGATE_CONV_WINOGRAD=0|1|2|4 sets the start
// value. Returns the previous mode; throws std::invalid_argument on another value.
int set_conv_winograd(int mode);
int conv_winograd();

// The output tile m (2 or 4) for this convolution under the current mode, 0:
// the im2col path. `eligible`: 3x3, stride 1, dilation 1, groups 1, no input
// scale (the caller checks those).
int winograd_tile(const WinogradGeometry& g, bool eligible);

// winograd_tile for a 2-D convolution as conv_cpu would run it (x [N, C, H, W],
// w [O, C / groups, kh, kw], torch's parameters, padding_hi empty: the same as
// padding): for the exec function, which transforms a constant's weights once.
int winograd_tile_for(const mlx::core::array& x, const mlx::core::array& w, const std::vector<int>& stride,
                      const std::vector<int>& padding, const std::vector<int>& padding_hi,
                      const std::vector<int>& dilation, int groups, bool has_in_scale);

// The geometry of such a convolution (after winograd_tile_for took it), without the epilogue.
WinogradGeometry winograd_geometry(const mlx::core::array& x, const mlx::core::array& w,
                                   const std::vector<int>& padding, const std::vector<int>& padding_hi);

// w [O, C, 3, 3] (float32, row-major) as U [(m + 2)^2, O, C]: element e of
// tile position (u, v) is U[e = u * (m + 2) + v] = (G w G^T)[u][v], computed in
// float64. `u` holds (m + 2)^2 * O * C floats.
void winograd_weights(const float* w, int O, int C, int m, float* u);
// The same as an evaluated float32 array (a constant weight's, made once per
// loaded program by the convolution's exec function).
mlx::core::array winograd_weights(const mlx::core::array& w, int m);
// m for weights of that shape made by winograd_weights (0: not such weights).
int winograd_weights_tile(const mlx::core::array& u, int O, int C);

// y [N, O, OH, OW] = conv(x [N, C, H, W], w) + bias [O] (optional) + residual
// (optional, y's shape), clamped, then the activation; u from winograd_weights.
// `pack`: u laid out for the serial sgemm's tile (winograd_packed_weights), used
// where it still fits that tile; returns whether a product ran on it.
bool winograd_conv(const WinogradGeometry& g, int m, const float* x, const float* u, const float* bias,
                   const float* residual, float* y, const mlx::core::array* pack = nullptr);
// A constant weight's u (winograd_weights, evaluated) laid out once for the serial sgemm's tile
// (serial_sgemm_pack), for this geometry's products: [(m + 2)^2, floats]; no floats where MKL serves
// the products.
mlx::core::array winograd_packed_weights(const mlx::core::array& u, int m, const WinogradGeometry& g);

}  // namespace mlxd::rt
