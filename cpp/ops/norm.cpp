// Normalisations: layer/RMS norm map to MLX's fused kernels; group and batch
// norm (and linalg.vector_norm) are composed, computing half types in float32
// as torch does.
#include <cmath>
#include <limits>
#include <numeric>

#include <mlx/fast.h>

#include "../ops_common.h"
#include "kernels/rows_cpu.h"

namespace mlxd::rt {

namespace {
std::optional<mx::array> optional_in(ExecContext& ctx, const mlxd::Tid* t) {
  if (auto* a = ctx.maybe_in(t)) return *a;
  return std::nullopt;
}

bool is_half(mx::Dtype t) { return t == mx::float16 || t == mx::bfloat16; }
mx::array upcast(const mx::array& x) { return is_half(x.dtype()) ? mx::astype(x, mx::float32) : x; }

std::optional<mx::array> flat_param(ExecContext& ctx, const mlxd::Tid* t, mx::Dtype dtype) {
  if (auto* a = ctx.maybe_in(t)) return mx::astype(mx::flatten(*a), dtype);
  return std::nullopt;
}

// x with its trailing `k` axes merged into one (mx::fast kernels normalise the
// last axis only). Sizes are explicit so that empty inputs reshape too.
mx::array merge_trailing(const mx::array& x, int k) {
  if (k < 1 || k > x.ndim()) throw NodeError("normalized_ndim out of range");
  mx::Shape s(x.shape().begin(), x.shape().end() - k);
  int inner = 1;
  for (int i = x.ndim() - k; i < x.ndim(); ++i) inner *= x.shape(i);
  s.push_back(inner);
  return mx::reshape(x, s);
}

// Per-row statistics of the last axis, shaped for torch: mean and 1/std with
// the normalised axes kept as size 1.
void set_stats(ExecContext& ctx, const mlxd::Tid* out_mean, const mlxd::Tid* out_rstd, const mx::array& rows,
               mx::Shape stat_shape, float eps, mx::Dtype dtype) {
  if (out_mean == nullptr && out_rstd == nullptr) return;
  auto xf = upcast(rows);
  auto mean = mx::mean(xf, -1, true);
  if (out_mean) ctx.set(out_mean, mx::astype(mx::reshape(mean, stat_shape), dtype));
  if (out_rstd) {
    auto rstd = mx::rsqrt(mx::add(mx::var(xf, -1, true), mx::array(eps, xf.dtype())));
    ctx.set(out_rstd, mx::astype(mx::reshape(rstd, stat_shape), dtype));
  }
}

// Shape broadcasting a per-channel (C,) vector along axis 1 of an ndim array.
mx::Shape channel_shape(int ndim) {
  mx::Shape s(ndim, 1);
  if (ndim > 1) s[1] = -1;
  return s;
}

mx::array affine(mx::array y, ExecContext& ctx, const mlxd::Tid* weight, const mlxd::Tid* bias) {
  auto shape = channel_shape(y.ndim());
  if (auto* w = ctx.maybe_in(weight)) y = mx::multiply(y, mx::reshape(upcast(*w), shape));
  if (auto* b = ctx.maybe_in(bias)) y = mx::add(y, mx::reshape(upcast(*b), shape));
  return y;
}

// Layer / RMS norm over the last axis: the CPU row kernel where it applies
// (MLX's CPU norms run on one core), MLX's fused kernel otherwise.
mx::array layer_norm_last(const mx::array& x, const std::optional<mx::array>& w, const std::optional<mx::array>& b,
                          float eps) {
  if (rows_cpu_applies(x, w, b)) return rows_cpu(x, RowKernel::layer_norm, eps, w, b);
  return mx::fast::layer_norm(x, w, b, eps);
}


std::vector<int> all_but_channel(int ndim) {
  std::vector<int> axes;
  for (int i = 0; i < ndim; ++i)
    if (i != 1) axes.push_back(i);
  return axes;
}
}  // namespace

mx::array rms_norm_last(const mx::array& x, const std::optional<mx::array>& w, float eps) {
  if (rows_cpu_applies(x, w)) return rows_cpu(x, RowKernel::rms_norm, eps, w);
  return mx::fast::rms_norm(x, w, eps);
}

void exec_LayerNormNode(const mlxd::LayerNormNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int k = n.normalized_ndim();
  if (k == 1 && !n.out_mean() && !n.out_rstd()) {
    ctx.set(n.out(), layer_norm_last(x, optional_in(ctx, n.weight()), optional_in(ctx, n.bias()), n.eps()));
    return;
  }
  auto rows = merge_trailing(x, k);
  auto y = layer_norm_last(rows, flat_param(ctx, n.weight(), x.dtype()), flat_param(ctx, n.bias(), x.dtype()), n.eps());
  ctx.set(n.out(), mx::reshape(y, x.shape()));
  mx::Shape stat_shape(x.shape().begin(), x.shape().end() - k);
  stat_shape.insert(stat_shape.end(), k, 1);
  set_stats(ctx, n.out_mean(), n.out_rstd(), rows, stat_shape, n.eps(), x.dtype());
}

void exec_RmsNormNode(const mlxd::RmsNormNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int k = n.normalized_ndim();
  if (k == 1) {
    ctx.set(n.out(), rms_norm_last(x, optional_in(ctx, n.weight()), n.eps()));
    return;
  }
  auto y = rms_norm_last(merge_trailing(x, k), flat_param(ctx, n.weight(), x.dtype()), n.eps());
  ctx.set(n.out(), mx::reshape(y, x.shape()));
}

void exec_GroupNormNode(const mlxd::GroupNormNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int g = n.groups();
  if (x.ndim() < 2 || g < 1 || x.shape(1) % g != 0) throw NodeError("group norm needs (N, C, *) with C % groups == 0");
  int batch = x.shape(0), per_group = x.shape(1) / g;
  for (int i = 2; i < x.ndim(); ++i) per_group *= x.shape(i);
  auto rows = mx::reshape(upcast(x), {batch, g, per_group});
  auto mean = mx::mean(rows, -1, true);
  auto rstd = mx::rsqrt(mx::add(mx::var(rows, -1, true), mx::array(n.eps(), rows.dtype())));
  auto y = mx::reshape(mx::multiply(mx::subtract(rows, mean), rstd), x.shape());
  ctx.set(n.out(), mx::astype(affine(y, ctx, n.weight(), n.bias()), x.dtype()));
  if (n.out_mean()) ctx.set(n.out_mean(), mx::astype(mx::reshape(mean, {batch, g}), x.dtype()));
  if (n.out_rstd()) ctx.set(n.out_rstd(), mx::astype(mx::reshape(rstd, {batch, g}), x.dtype()));
}

void exec_BatchNormNode(const mlxd::BatchNormNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  if (x.ndim() < 2) throw NodeError("batch norm needs (N, C, *) input");
  auto xf = upcast(x);
  auto shape = channel_shape(x.ndim());
  mx::array mean = mx::array(0.f), var = mx::array(0.f);
  auto* running_mean = ctx.maybe_in(n.mean());
  auto* running_var = ctx.maybe_in(n.var());
  if (running_mean && running_var) {
    mean = mx::reshape(upcast(*running_mean), shape);
    var = mx::reshape(upcast(*running_var), shape);
  } else if (!running_mean && !running_var) {  // training mode: this batch's (biased) statistics
    mean = mx::mean(xf, all_but_channel(x.ndim()), true);
    var = mx::var(xf, all_but_channel(x.ndim()), true);
  } else {
    throw NodeError("batch norm needs both running statistics or neither");
  }
  auto rstd = mx::rsqrt(mx::add(var, mx::array(n.eps(), var.dtype())));
  auto y = mx::multiply(mx::subtract(xf, mean), rstd);
  ctx.set(n.out(), mx::astype(affine(y, ctx, n.weight(), n.bias()), x.dtype()));
  if (n.out_mean()) ctx.set(n.out_mean(), mx::astype(mx::flatten(mean), x.dtype()));
  if (n.out_rstd()) ctx.set(n.out_rstd(), mx::astype(mx::flatten(rstd), x.dtype()));
}

void exec_VectorNormNode(const mlxd::VectorNormNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  std::vector<int> axes;
  for (int a : int_vector(n.axes())) axes.push_back(normalize_axis(a, x.ndim()));
  if (axes.empty()) {
    axes.resize(x.ndim());
    std::iota(axes.begin(), axes.end(), 0);
  }
  bool keep = n.keepdims();
  double p = n.ord();
  auto a = mx::abs(upcast(x));
  mx::array r = a;
  if (std::isinf(p)) {
    r = p > 0 ? mx::max(a, axes, keep) : mx::min(a, axes, keep);
  } else if (p == 0) {
    r = mx::sum(mx::astype(mx::not_equal(a, mx::array(0, a.dtype())), a.dtype()), axes, keep);
  } else if (p == 1) {
    r = mx::sum(a, axes, keep);
  } else if (p == 2) {
    r = mx::sqrt(mx::sum(mx::square(a), axes, keep));
  } else {
    auto pa = mx::array(p, a.dtype());
    r = mx::power(mx::sum(mx::power(a, pa), axes, keep), mx::array(1.0 / p, a.dtype()));
  }
  ctx.set(n.out(), mx::astype(r, x.dtype()));
}

}  // namespace mlxd::rt
