// Convolution, pooling and resampling on torch's channels-first layout
// (N, C, *spatial). On the CPU, 1-D / 2-D convolutions and max pooling run the
// channels-first kernels (kernels/conv_cpu.h, kernels/pool_cpu.h); inverted-residual
// blocks run as one kernel (kernels/block_cpu.h). Otherwise
// MLX convolves channels-last, so data and weights are transposed around the
// call; pooling and resampling are composed from MLX ops.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>

#include "../ops_common.h"
#include "kernels/block_cpu.h"
#include "kernels/conv_cpu.h"
#include "kernels/pool_cpu.h"
#include "kernels/reduce_cpu.h"
#include "kernels/winograd_cpu.h"

namespace mlxd::rt {
namespace {

mx::array channels_last(const mx::array& x) { return mx::moveaxis(x, 1, -1); }
mx::array channels_first(const mx::array& x) { return mx::moveaxis(x, -1, 1); }

bool is_half(mx::Dtype t) { return t == mx::float16 || t == mx::bfloat16; }

// A per-spatial-axis parameter list; an absent field means `fill` everywhere.
std::vector<int> per_axis(const flatbuffers::Vector<int32_t>* v, size_t nd, int fill, const char* what) {
  auto out = int_vector(v);
  if (out.empty()) out.assign(nd, fill);
  if (out.size() != nd) throw NodeError(std::string(what) + " needs one entry per spatial axis");
  return out;
}

// ------------------------------------------------------------- convolution
struct ConvParams {
  std::vector<int> stride, pad_lo, pad_hi, dilation, input_dilation;
  int groups = 1;
  bool flip = false;
};

mx::array conv_nlc(const mx::array& x, const mx::array& w, const ConvParams& p) {
  return mx::conv_general(x, w, p.stride, p.pad_lo, p.pad_hi, p.dilation, p.input_dilation, p.groups, p.flip);
}

// MLX only groups 1-D and 2-D convolutions: other ranks convolve group by group.
mx::array grouped_conv(const mx::array& x, const mx::array& w, ConvParams p) {
  if (p.groups == 1 || x.ndim() <= 4) return conv_nlc(x, w, p);
  int g = p.groups;
  p.groups = 1;
  auto xs = mx::split(x, g, -1);
  auto ws = mx::split(w, g, 0);
  std::vector<mx::array> ys;
  for (int i = 0; i < g; ++i) ys.push_back(conv_nlc(xs[i], ws[i], p));
  return mx::concatenate(ys, -1);
}

// torch's transposed weight [I, O/g, *k] as MLX's [O, *k, I/g].
mx::array transposed_weight(const mx::array& w, int groups) {
  int in = w.shape(0), og = w.shape(1);
  mx::Shape k(w.shape().begin() + 2, w.shape().end());
  mx::Shape grouped{groups, in / groups, og};
  grouped.insert(grouped.end(), k.begin(), k.end());
  auto wg = mx::moveaxis(mx::reshape(w, grouped), 1, -1);  // [g, O/g, *k, I/g]
  mx::Shape out{groups * og};
  out.insert(out.end(), k.begin(), k.end());
  out.push_back(in / groups);
  return mx::reshape(wg, out);
}

// A transposed convolution is a convolution of the stride-dilated input with
// the flipped kernel, padded by dilation*(k-1) - padding (+ output_padding on
// the high side). Negative pads are applied as a crop of the result instead.
mx::array conv_transpose(const mx::array& x, const mx::array& w, const std::vector<int>& stride,
                         const std::vector<int>& padding, const std::vector<int>& dilation,
                         const std::vector<int>& output_padding, int groups) {
  size_t nd = stride.size();
  auto wt = transposed_weight(w, groups);
  ConvParams p{std::vector<int>(nd, 1), {}, {}, dilation, stride, groups, true};
  std::vector<int> crop_lo(nd), crop_hi(nd);
  for (size_t i = 0; i < nd; ++i) {
    int lo = dilation[i] * (wt.shape(1 + i) - 1) - padding[i];
    int hi = lo + output_padding[i];
    p.pad_lo.push_back(std::max(lo, 0));
    p.pad_hi.push_back(std::max(hi, 0));
    crop_lo[i] = std::max(-lo, 0);
    crop_hi[i] = std::max(-hi, 0);
  }
  auto y = grouped_conv(x, wt, p);
  if (std::any_of(crop_lo.begin(), crop_lo.end(), [](int c) { return c > 0; }) ||
      std::any_of(crop_hi.begin(), crop_hi.end(), [](int c) { return c > 0; })) {
    mx::Shape start(y.ndim(), 0), stop = y.shape();
    for (size_t i = 0; i < nd; ++i) {
      start[1 + i] = crop_lo[i];
      stop[1 + i] = std::max(y.shape(1 + i) - crop_hi[i], crop_lo[i]);
    }
    y = mx::slice(y, start, stop);
  }
  return y;
}

// --------------------------------------------------------------- pooling
struct Window {
  std::vector<int> kernel, stride, padding, dilation;
  bool ceil_mode = false;
};

// torch's pooled length, including the ceil-mode rule that the last window
// must start inside the input or its left padding.
int pooled_size(int in, int k, int s, int p, int d, bool ceil_mode) {
  // int64: a payload's dilation * kernel may overflow int.
  int64_t span = int64_t(in) + 2 * int64_t(p) - int64_t(d) * (k - 1) - 1 + (ceil_mode ? s - 1 : 0);
  // Floor division: in ceil mode a window wider than the input still yields one
  // output (EfficientNet's AvgPool2d(hidden_dim, ceil_mode=True) over a 1x1 map).
  int64_t out = (span >= 0 ? span / s : -((-span + s - 1) / s)) + 1;
  if (ceil_mode && (out - 1) * s >= int64_t(in) + p) --out;
  if (out < 1) throw NodeError("pooling window is larger than the padded input");
  return static_cast<int>(out);
}

std::vector<int> pooled_sizes(const mx::Shape& spatial, const Window& w) {
  std::vector<int> out;
  for (size_t i = 0; i < spatial.size(); ++i)
    out.push_back(pooled_size(spatial[i], w.kernel[i], w.stride[i], w.padding[i], w.dilation[i], w.ceil_mode));
  return out;
}

// Padding that makes every window of `outs` lie inside the array: torch's
// padding on the low side, as much as the last window needs on the high side.
std::vector<std::pair<int, int>> window_padding(const mx::Shape& spatial, const Window& w,
                                                const std::vector<int>& outs) {
  std::vector<std::pair<int, int>> pads;
  for (size_t i = 0; i < spatial.size(); ++i) {
    int need = (outs[i] - 1) * w.stride[i] + w.dilation[i] * (w.kernel[i] - 1) + 1 - spatial[i] - w.padding[i];
    pads.emplace_back(w.padding[i], std::max(need, 0));
  }
  return pads;
}

// Pads the trailing axes of x with `value`.
mx::array pad_trailing(const mx::array& x, const std::vector<std::pair<int, int>>& pads, const mx::array& value) {
  std::vector<int> axes;
  mx::Shape lo, hi;
  int nd = static_cast<int>(pads.size());
  for (int i = 0; i < nd; ++i) {
    axes.push_back(x.ndim() - nd + i);
    lo.push_back(pads[i].first);
    hi.push_back(pads[i].second);
  }
  return mx::pad(x, axes, lo, hi, value);
}

// A view of the (padded) x as (*lead, *outs, *kernel): every pooling window.
mx::array windows(const mx::array& x, const Window& w, const std::vector<int>& outs) {
  int nd = static_cast<int>(outs.size());
  int lead = x.ndim() - nd;
  mx::Strides strides(x.ndim(), 1);
  for (int i = x.ndim() - 2; i >= 0; --i) strides[i] = strides[i + 1] * x.shape(i + 1);
  mx::Shape shape(x.shape().begin(), x.shape().begin() + lead);
  mx::Strides view(strides.begin(), strides.begin() + lead);
  for (int i = 0; i < nd; ++i) {
    shape.push_back(outs[i]);
    view.push_back(strides[lead + i] * w.stride[i]);
  }
  for (int i = 0; i < nd; ++i) {
    shape.push_back(w.kernel[i]);
    view.push_back(strides[lead + i] * w.dilation[i]);
  }
  return mx::as_strided(x, shape, view, 0);
}

// The window with each undilated kernel cut to the padded input's extent: a
// window never reaches past it (pooled_size starts the last window inside),
// so the cut-off part held only padding and the overhang, which neither the
// sums, the maxima nor torch's counts read. EfficientNet's
// AvgPool2d(1280, ceil_mode=True) over a 7x7 map would otherwise view
// 1280 x 1280 windows (billions of elements).
Window within_input(Window w, const mx::Shape& spatial) {
  for (size_t i = 0; i < spatial.size(); ++i)
    if (w.dilation[i] == 1) w.kernel[i] = std::min(w.kernel[i], spatial[i] + 2 * w.padding[i]);
  return w;
}

std::vector<int> trailing_axes(int ndim, int count) {
  std::vector<int> axes(count);
  std::iota(axes.begin(), axes.end(), ndim - count);
  return axes;
}

mx::array lowest(mx::Dtype t) {
  return mx::array(-std::numeric_limits<float>::infinity(), t);
}

// Max pooling, with torch's flat spatial index of each maximum when asked.
std::pair<mx::array, std::optional<mx::array>> max_pool(const mx::array& x, Window w, bool want_indices) {
  int nd = static_cast<int>(w.kernel.size());
  mx::Shape spatial(x.shape().end() - nd, x.shape().end());
  auto outs = pooled_sizes(spatial, w);
  w = within_input(w, spatial);  // after the output sizes, which depend on the full kernel
  auto pads = window_padding(spatial, w, outs);
  auto win = windows(pad_trailing(x, pads, lowest(x.dtype())), w, outs);
  auto kaxes = trailing_axes(win.ndim(), nd);
  if (!want_indices) return {mx::max(win, kaxes), std::nullopt};
  // Flatten each window, take the first maximum (torch's tie rule) and read
  // its position from the same windows over an iota of the spatial plane.
  mx::Shape flat(win.shape().begin(), win.shape().end() - nd);
  flat.push_back(-1);
  auto vals = mx::reshape(win, flat);
  auto arg = mx::expand_dims(mx::argmax(vals, -1), -1);
  int plane = 1;
  for (int s : spatial) plane *= s;
  auto iota = mx::reshape(mx::arange(plane, mx::int64), spatial);
  auto iwin = windows(pad_trailing(iota, pads, mx::array(-1, mx::int64)), w, outs);
  mx::Shape iflat(iwin.shape().begin(), iwin.shape().end() - nd);
  iflat.push_back(-1);
  auto idx = mx::reshape(iwin, iflat);
  mx::Shape bshape(arg.shape());
  bshape.back() = idx.shape(-1);
  auto picked = mx::take_along_axis(mx::broadcast_to(idx, bshape), arg, -1);
  auto values = mx::squeeze(mx::take_along_axis(vals, arg, -1), -1);
  return {values, mx::squeeze(picked, -1)};
}

// Average pooling: window sums over the zero-padded input divided by torch's
// count (padding counts when count_include_pad, the ceil-mode overhang never).
mx::array avg_pool(const mx::array& x, Window w, bool count_include_pad, int divisor) {
  int nd = static_cast<int>(w.kernel.size());
  auto dtype = x.dtype();
  mx::Shape spatial(x.shape().end() - nd, x.shape().end());
  auto outs = pooled_sizes(spatial, w);
  w = within_input(w, spatial);  // after the output sizes, which depend on the full kernel
  // One unpadded window over the whole map (global average pooling: a CNN's
  // head, every squeeze-excite gate) is a mean over the flattened map: on the
  // CPU the reduction kernel, instead of MLX's window view and single-core sum (0.6
  // ms for MobileNetV2's 1280 x 7x7 head).
  bool whole = divisor <= 0;
  std::vector<int> map_axes;
  for (int i = 0; i < nd; ++i) {
    whole = whole && outs[i] == 1 && w.padding[i] == 0 && w.kernel[i] == spatial[i] &&
            (w.dilation[i] == 1 || spatial[i] == 1);
    map_axes.push_back(static_cast<int>(x.ndim()) - nd + i);
  }
  if (whole && reduce_cpu_applies(x, map_axes)) return reduce_cpu(x, ReduceKind::mean, map_axes, true);
  auto xf = is_half(dtype) ? mx::astype(x, mx::float32) : x;  // torch accumulates halves in float
  auto pads = window_padding(spatial, w, outs);
  auto zero = mx::array(0, xf.dtype());
  auto sums = mx::sum(windows(pad_trailing(xf, pads, zero), w, outs), trailing_axes(x.ndim() + nd, nd));
  mx::array count = mx::array(static_cast<float>(divisor), xf.dtype());
  if (divisor <= 0) {
    std::vector<std::pair<int, int>> torch_pad, overhang;
    for (size_t i = 0; i < pads.size(); ++i) {
      torch_pad.emplace_back(w.padding[i], w.padding[i]);
      overhang.emplace_back(0, std::max(pads[i].second - w.padding[i], 0));
    }
    auto ones = mx::ones(spatial, xf.dtype());
    auto mask = pad_trailing(ones, torch_pad, mx::array(count_include_pad ? 1 : 0, xf.dtype()));
    mask = pad_trailing(mask, overhang, zero);
    count = mx::sum(windows(mask, w, outs), trailing_axes(2 * nd, nd));
  }
  return mx::astype(mx::divide(sums, count), dtype);
}

// ------------------------------------------------------------ resampling
using ResampleMode = mlxd::ResampleMode;

// torch's area_pixel_compute_scale / compute_scales_value, in float.
float source_scale(int in, int out, double scale_factor, bool align_corners) {
  if (align_corners) return out > 1 ? static_cast<float>(in - 1) / static_cast<float>(out - 1) : 0.f;
  if (scale_factor > 0) return static_cast<float>(1.0 / scale_factor);
  return static_cast<float>(in) / static_cast<float>(out);
}

mx::array nearest_axis(const mx::array& x, int axis, int out, float scale, bool exact) {
  int in = x.shape(axis);
  auto dst = mx::arange(out, mx::float32);
  if (exact) dst = mx::add(dst, mx::array(0.5f));
  auto src = mx::astype(mx::floor(mx::multiply(dst, mx::array(scale))), mx::int32);
  return mx::take(x, mx::minimum(src, mx::array(in - 1, mx::int32)), axis);
}

// Linear interpolation along one axis (x already in float32).
mx::array linear_axis(const mx::array& x, int axis, int out, float scale, bool align_corners) {
  int in = x.shape(axis);
  auto dst = mx::arange(out, mx::float32);
  mx::array src = align_corners
                      ? mx::multiply(dst, mx::array(scale))
                      : mx::maximum(mx::subtract(mx::multiply(mx::add(dst, mx::array(0.5f)), mx::array(scale)),
                                                 mx::array(0.5f)),
                                    mx::array(0.f));
  auto last = mx::array(in - 1, mx::int32);
  auto i0 = mx::minimum(mx::astype(mx::floor(src), mx::int32), last);
  auto i1 = mx::minimum(mx::add(i0, mx::array(1, mx::int32)), last);
  auto l1 = mx::clip(mx::subtract(src, mx::astype(i0, mx::float32)), mx::array(0.f), mx::array(1.f));
  mx::Shape bshape(x.ndim(), 1);
  bshape[axis] = out;
  l1 = mx::reshape(l1, bshape);
  auto a = mx::take(x, i0, axis), b = mx::take(x, i1, axis);
  return mx::add(a, mx::multiply(mx::subtract(b, a), l1));
}

// What follows MLX's convolution (channels-first y) off the CPU kernel: bias, residual, clamp, the
// cast back to the input's dtype, then the activation.
mx::array conv_epilogue(mx::array y, mx::Dtype dtype, const mx::array* bias, const mx::array* residual,
                        std::optional<std::pair<float, float>> clamp, std::optional<mlxd::UnaryOp> act) {
  if (bias) {
    mx::Shape bshape(y.ndim() - 1, 1);
    bshape[0] = -1;
    y = mx::add(y, mx::reshape(*bias, bshape));
  }
  if (residual) {
    if (residual->shape() != y.shape()) throw NodeError("conv residual does not have the output's shape");
    y = mx::add(y, *residual);
  }
  if (clamp) y = mx::clip(y, mx::array(clamp->first, y.dtype()), mx::array(clamp->second, y.dtype()));
  y = mx::astype(y, dtype);
  return act ? unary_op(*act, y) : y;
}

// A non-transposed convolution as ConvNode runs it: the channels-first CPU
// kernel where it applies, else MLX's channels-last convolution, then bias,
// residual, clamp and the activation as MLX ops (in_scale, a squeeze-excite gate,
// multiplies x per image and channel first). The result has x's dtype.
mx::array conv_forward(const mx::array& x, const mx::array& w, const mx::array* bias, const std::vector<int>& stride,
                       const std::vector<int>& padding, const std::vector<int>& padding_hi,
                       const std::vector<int>& dilation, int groups, std::optional<std::pair<float, float>> clamp,
                       const mx::array* residual, const mx::array* in_scale = nullptr,
                       std::optional<mlxd::UnaryOp> act = std::nullopt, const mx::array* winograd_w = nullptr,
                       const mx::array* packed_w = nullptr) {
  // The activation inside the CPU kernel's epilogue when it has one, else after the convolution.
  const std::optional<UnaryKernel> act_kernel = act ? cpu_kernel_for(*act) : std::nullopt;
  if (conv_cpu_applies(x, w, bias, groups, residual, in_scale)) {  // channels-first, no transposes
    std::optional<mx::array> b, r, s, u, p;
    if (bias) b = *bias;
    if (residual) r = *residual;
    if (in_scale) s = *in_scale;
    if (winograd_w) u = *winograd_w;
    if (packed_w) p = *packed_w;
    auto y = conv_cpu(x, w, b, stride, padding, dilation, groups, clamp, padding_hi, r, act_kernel, s, u, p);
    return act && !act_kernel ? unary_op(*act, y) : y;
  }
  mx::Shape scale_shape(x.ndim(), 1);
  scale_shape[0] = x.shape(0);
  scale_shape[1] = x.shape(1);
  auto xl = channels_last(in_scale ? mx::multiply(x, mx::reshape(*in_scale, scale_shape)) : x);
  auto y = channels_first(grouped_conv(xl, channels_last(w), {stride, padding, padding_hi, dilation, {}, groups, false}));
  return conv_epilogue(y, x.dtype(), bias, residual, clamp, act);
}

// BlockActivation's function after the clamp, one row per kind in the schema's order (Clamp: none).
constexpr std::array<std::optional<mlxd::UnaryOp>, 7> kBlockActs{
    std::nullopt, mlxd::UnaryOp::Hardswish, mlxd::UnaryOp::Hardsigmoid, mlxd::UnaryOp::Sigmoid,
    mlxd::UnaryOp::Silu, mlxd::UnaryOp::GeluErf, mlxd::UnaryOp::GeluTanh};

// A block stage's activation: ConvNode's clamp (none when both bounds are infinite) and act, and the
// CPU kernel's form of both.
struct StageAct {
  std::optional<std::pair<float, float>> clamp;
  std::optional<mlxd::UnaryOp> act;
  BlockActivation cpu;
  bool cpu_ok = true;  // the function has a CPU map (every row of kBlockActs has)
};

StageAct stage_act(mlxd::BlockActivation kind, float lo, float hi, const char* what) {
  const auto k = static_cast<size_t>(kind);
  if (k >= kBlockActs.size()) throw NodeError(std::string("unknown ") + what + " activation");
  if (!(lo <= hi)) throw NodeError(std::string(what) + " activation bounds need lo <= hi");
  StageAct s;
  if (!(std::isinf(lo) && lo < 0 && std::isinf(hi) && hi > 0)) s.clamp = std::make_pair(lo, hi);
  s.act = kBlockActs[k];
  s.cpu = {lo, hi, -1};
  if (s.act) {
    auto kernel = cpu_kernel_for(*s.act);
    s.cpu_ok = kernel.has_value();
    if (kernel) s.cpu.act = static_cast<int>(*kernel);
  }
  return s;
}

}  // namespace

// derived_constant's keys for a convolution's packed weights (+ the tile m for the Winograd weights',
// which are under m itself).
constexpr int kConvPackKey = 16;
constexpr int kDwTapsKey = 15;  // an inverted-residual block's depthwise weight tap by tap

void exec_ConvNode(const mlxd::ConvNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  const auto& w = ctx.in(n.weight());
  if (x.ndim() < 3 || w.ndim() != x.ndim()) throw NodeError("conv needs (N, C, *spatial) input and weight");
  size_t nd = x.ndim() - 2;
  auto stride = per_axis(n.stride(), nd, 1, "stride");
  auto padding = per_axis(n.padding(), nd, 0, "padding");
  auto padding_hi = n.padding_hi() ? per_axis(n.padding_hi(), nd, 0, "padding_hi") : padding;
  auto dilation = per_axis(n.dilation(), nd, 1, "dilation");
  int groups = n.groups();
  if (groups < 1) throw NodeError("groups must be positive");
  if (n.transpose() && padding_hi != padding) throw NodeError("a transposed convolution has symmetric padding");
  const auto* bias = ctx.maybe_in(n.bias());
  const auto* residual = ctx.maybe_in(n.residual());
  const auto* in_scale = ctx.maybe_in(n.in_scale());
  if (in_scale && (n.transpose() || in_scale->size() != static_cast<size_t>(x.shape(0)) * x.shape(1)))
    throw NodeError("conv in_scale needs a non-transposed convolution and one value per image and input channel");
  std::optional<std::pair<float, float>> clamp;
  if (n.clamp()) clamp = {n.clamp_min(), n.clamp_max()};
  std::optional<mlxd::UnaryOp> act;
  if (n.act()) act = n.act_op();
  if (!n.transpose()) {
    // A constant 3x3 weight the CPU kernel will run as a Winograd convolution: transformed once per program.
    // Else a constant weight laid out once for the serial sgemm's tile (the per-image products).
    std::optional<mx::array> wino, pack;
    if (conv_cpu_applies(x, w, bias, groups, residual, in_scale)) {
      if (const int m = winograd_tile_for(x, w, stride, padding, padding_hi, dilation, groups, in_scale != nullptr)) {
        wino = ctx.derived_constant(n.weight(), m, [m](const mx::array& a) { return winograd_weights(a, m); });
        const WinogradGeometry g = winograd_geometry(x, w, padding, padding_hi);
        if (wino)  // a constant's transform: packed in turn
          pack = ctx.derived_constant(n.weight(), kConvPackKey + m,
                                      [&](const mx::array&) { return winograd_packed_weights(*wino, m, g); });
      } else if (auto hints = conv_pack_hints(x, w, stride, padding, padding_hi, dilation, groups, in_scale != nullptr))
        pack = ctx.derived_constant(n.weight(), kConvPackKey,
                                    [&](const mx::array& a) { return conv_pack_weights(a, groups, *hints); });
    }
    ctx.set(n.out(), conv_forward(x, w, bias, stride, padding, padding_hi, dilation, groups, clamp, residual,
                                  in_scale, act, wino ? &*wino : nullptr, pack ? &*pack : nullptr));
    return;
  }
  mx::array y = channels_first(conv_transpose(channels_last(x), w, stride, padding, dilation,
                                              per_axis(n.output_padding(), nd, 0, "output_padding"), groups));
  ctx.set(n.out(), conv_epilogue(y, x.dtype(), bias, residual, clamp, act));
}

// On the CPU, one kernel per block (kernels/block_cpu.h); elsewhere (GPUs,
// kernels off) the convolutions as ConvNodes run them, the squeeze-excite gate
// (mean, two 1x1 convolutions) as the project's in_scale.
void exec_InvertedResidualNode(const mlxd::InvertedResidualNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  const auto* we = ctx.maybe_in(n.expand_weight());
  const auto* be = ctx.maybe_in(n.expand_bias());
  const auto& wd = ctx.in(n.dw_weight());
  const auto* bd = ctx.maybe_in(n.dw_bias());
  const auto& wp = ctx.in(n.project_weight());
  const auto* bp = ctx.maybe_in(n.project_bias());
  const auto* residual = ctx.maybe_in(n.residual());
  const auto* wr = ctx.maybe_in(n.se_reduce_weight());
  const auto* br = ctx.maybe_in(n.se_reduce_bias());
  const auto* wx = ctx.maybe_in(n.se_expand_weight());
  const auto* bx = ctx.maybe_in(n.se_expand_bias());
  if (x.ndim() != 4 || wd.ndim() != 4 || wp.ndim() != 4 || (we && we->ndim() != 4))
    throw NodeError("inverted_residual needs an (N, C, H, W) input and 4-D weights");
  if (be && !we) throw NodeError("inverted_residual has an expand bias without an expand weight");
  if (!wr != !wx || (br && !wr) || (bx && !wx))
    throw NodeError("inverted_residual's squeeze-excite needs both weights (and biases only with them)");
  auto stride = per_axis(n.stride(), 2, 1, "stride");
  auto padding = per_axis(n.padding(), 2, 0, "padding");
  auto padding_hi = n.padding_hi() ? per_axis(n.padding_hi(), 2, 0, "padding_hi") : padding;
  const auto ea = stage_act(n.expand_act(), n.expand_lo(), n.expand_hi(), "expand");
  const auto da = stage_act(n.dw_act(), n.dw_lo(), n.dw_hi(), "depthwise");
  const StageAct none{};
  const auto ra = wr ? stage_act(n.se_reduce_act(), n.se_reduce_lo(), n.se_reduce_hi(), "squeeze-excite reduce") : none;
  const auto xa = wx ? stage_act(n.se_expand_act(), n.se_expand_lo(), n.se_expand_hi(), "squeeze-excite expand") : none;
  const int E = we ? we->shape(0) : x.shape(1);
  if (wd.shape(0) != E || wd.shape(1) != 1)
    throw NodeError("inverted_residual's depthwise weight is not [" + std::to_string(E) + ", 1, kh, kw]");
  if (wr && (wr->ndim() != 4 || wx->ndim() != 4 || wr->shape(1) != E || wx->shape(0) != E ||
             wx->shape(1) != wr->shape(0) || wr->shape(2) * wr->shape(3) != 1 || wx->shape(2) * wx->shape(3) != 1))
    throw NodeError("inverted_residual's squeeze-excite weights are not [S, " + std::to_string(E) + ", 1, 1] and [" +
                    std::to_string(E) + ", S, 1, 1]");
  BlockOperands ops{x, std::nullopt, std::nullopt, wd, std::nullopt, wp, std::nullopt, std::nullopt};
  auto opt = [](const mx::array* a) { return a ? std::optional<mx::array>(*a) : std::nullopt; };
  ops.expand_w = opt(we);
  ops.expand_b = opt(be);
  ops.dw_b = opt(bd);
  ops.project_b = opt(bp);
  ops.residual = opt(residual);
  ops.se_reduce_w = opt(wr);
  ops.se_reduce_b = opt(br);
  ops.se_expand_w = opt(wx);
  ops.se_expand_b = opt(bx);
  BlockParams p{stride[0], stride[1], padding[0], padding[1], padding_hi[0], padding_hi[1],
                ea.cpu, da.cpu, ra.cpu, xa.cpu};
  if (ea.cpu_ok && da.cpu_ok && ra.cpu_ok && xa.cpu_ok && block_cpu_applies(ops, p)) {
    // Constant 1x1 weights laid out once for the serial sgemm's tile.
    auto pack = [&](const mlxd::Tid* tid, bool project) -> std::optional<mx::array> {
      const auto hints = block_pack_hints(ops, p, project);
      if (!hints) return std::nullopt;
      return ctx.derived_constant(tid, kConvPackKey, [&](const mx::array& a) { return conv_pack_weights(a, 1, *hints); });
    };
    if (we) ops.expand_pack = pack(n.expand_weight(), false);
    ops.project_pack = pack(n.project_weight(), true);
    if (block_uses_taps(ops, p))
      ops.dw_taps = ctx.derived_constant(n.dw_weight(), kDwTapsKey, [](const mx::array& a) { return block_dw_taps(a); });
    try {
      ctx.set(n.out(), block_cpu(ops, p));
    } catch (const std::invalid_argument& e) {
      throw NodeError(e.what());
    }
    return;
  }
  const std::vector<int> one{1, 1}, zero{0, 0};
  auto conv1x1 = [&](const mx::array& h, const mx::array& w, const mx::array* b, const StageAct& a,
                     const mx::array* res = nullptr, const mx::array* scale = nullptr) {
    return conv_forward(h, w, b, one, zero, zero, one, 1, a.clamp, res, scale, a.act);
  };
  mx::array h = we ? conv1x1(x, *we, be, ea) : x;
  h = conv_forward(h, wd, bd, stride, padding, padding_hi, one, E, da.clamp, nullptr, nullptr, da.act);
  std::optional<mx::array> gate;
  if (wr) {
    // The mean in float32 (eager's reduction accumulates in float32 for half types too).
    auto m = mx::astype(mx::mean(mx::astype(h, mx::float32), std::vector<int>{2, 3}, true), h.dtype());
    gate = conv1x1(conv1x1(m, *wr, br, ra), *wx, bx, xa);
  }
  ctx.set(n.out(), conv1x1(h, wp, bp, none, residual, gate ? &*gate : nullptr));
}

void exec_PoolNode(const mlxd::PoolNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto kernel = int_vector(n.kernel());
  size_t nd = kernel.size();
  if (nd == 0 || nd > static_cast<size_t>(x.ndim())) throw NodeError("pool kernel rank does not fit the input");
  Window w{kernel, per_axis(n.stride(), nd, 1, "stride"), per_axis(n.padding(), nd, 0, "padding"),
           per_axis(n.dilation(), nd, 1, "dilation"), n.ceil_mode()};
  if (n.op() == mlxd::PoolOp::Max) {
    if (n.out_indices() == nullptr && max_pool_cpu_applies(x, nd)) {  // windows read in place
      mx::Shape spatial(x.shape().end() - nd, x.shape().end());
      ctx.set(n.out(), max_pool_cpu(x, w.kernel, w.stride, w.padding, w.dilation, pooled_sizes(spatial, w)));
      return;
    }
    auto [values, indices] = max_pool(x, w, n.out_indices() != nullptr);
    ctx.set(n.out(), values);
    if (indices) ctx.set(n.out_indices(), *indices);
    return;
  }
  if (n.out_indices() != nullptr) throw NodeError("only max pooling has indices");
  ctx.set(n.out(), avg_pool(x, w, n.count_include_pad(), n.divisor()));
}

void exec_ResampleNode(const mlxd::ResampleNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  size_t nd = n.size() ? n.size()->size() : 0;
  auto scales = n.scales();
  if (nd == 0 || nd > static_cast<size_t>(x.ndim()) || (scales && scales->size() != nd))
    throw NodeError("resample needs one size (and scale) per resized axis");
  bool linear = n.mode() == ResampleMode::Linear;
  mx::array y = linear && is_half(x.dtype()) ? mx::astype(x, mx::float32) : x;
  for (size_t i = 0; i < nd; ++i) {
    int axis = x.ndim() - static_cast<int>(nd) + static_cast<int>(i);
    double factor = scales ? scales->Get(i) : 0.0;
    int64_t out = ctx.resolve(n.size()->Get(i));
    if (out < 0) {  // torch's size from a scale factor: floor(in * scale) in double
      if (factor <= 0) throw NodeError("resample size from a scale needs a positive scale");
      out = static_cast<int64_t>(std::floor(static_cast<double>(x.shape(axis)) * factor));
    }
    if (out == 0 || x.shape(axis) == 0) throw NodeError("resample of an empty axis");
    float scale = source_scale(x.shape(axis), static_cast<int>(out), factor, linear && n.align_corners());
    if (linear)
      y = linear_axis(y, axis, static_cast<int>(out), scale, n.align_corners());
    else
      y = nearest_axis(y, axis, static_cast<int>(out), scale, n.mode() == ResampleMode::NearestExact);
  }
  ctx.set(n.out(), mx::astype(y, x.dtype()));
}

void exec_PixelShuffleNode(const mlxd::PixelShuffleNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int r = n.factor(), nd = x.ndim();
  if (r < 1 || nd < 3) throw NodeError("pixel shuffle needs a positive factor and (*, C, H, W) input");
  mx::Shape lead(x.shape().begin(), x.shape().end() - 3);
  int c = x.shape(-3), h = x.shape(-2), w = x.shape(-1);
  int b = static_cast<int>(lead.size());
  auto with_lead = [&](std::initializer_list<int> dims) {
    mx::Shape s = lead;
    for (int d : dims) s.push_back(d);
    return s;
  };
  std::vector<int> perm(b);
  std::iota(perm.begin(), perm.end(), 0);
  mx::array y = x;
  if (!n.inverse()) {  // (C*r*r, H, W) -> (C, r, r, H, W) -> (C, H, r, W, r)
    if (c % (r * r) != 0) throw NodeError("channels not divisible by factor^2");
    y = mx::reshape(x, with_lead({c / (r * r), r, r, h, w}));
    for (int p : {0, 3, 1, 4, 2}) perm.push_back(b + p);
    y = mx::reshape(mx::transpose(y, perm), with_lead({c / (r * r), h * r, w * r}));
  } else {  // (C, H*r, W*r) -> (C, H, r, W, r) -> (C, r, r, H, W)
    if (h % r != 0 || w % r != 0) throw NodeError("spatial size not divisible by factor");
    y = mx::reshape(x, with_lead({c, h / r, r, w / r, r}));
    for (int p : {0, 2, 4, 1, 3}) perm.push_back(b + p);
    y = mx::reshape(mx::transpose(y, perm), with_lead({c * r * r, h / r, w / r}));
  }
  ctx.set(n.out(), y);
}

}  // namespace mlxd::rt
