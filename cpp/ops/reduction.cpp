// Reductions, arg-reductions, softmax, variance, scans, sorting and selection.
#include <algorithm>
#include <array>
#include <numeric>
#include <optional>

#include "../ops_common.h"
#include "kernels/reduce_cpu.h"
#include "kernels/rows_cpu.h"

namespace mlxd::rt {
namespace {

using Reduce = mx::array (*)(const mx::array&, const std::vector<int>&, bool);

// One row per `enum ReduceOp` value, keyed by it (checked at compile time).
constexpr std::array<OpRow<mlxd::ReduceOp, Reduce>, enum_size<mlxd::ReduceOp>()> kReduce = {{
    {mlxd::ReduceOp::Sum, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::sum(x, ax, k); }},
    {mlxd::ReduceOp::Mean, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::mean(x, ax, k); }},
    {mlxd::ReduceOp::Max, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::max(x, ax, k); }},
    {mlxd::ReduceOp::Min, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::min(x, ax, k); }},
    {mlxd::ReduceOp::Prod, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::prod(x, ax, k); }},
    {mlxd::ReduceOp::Any, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::any(x, ax, k); }},
    {mlxd::ReduceOp::All, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::all(x, ax, k); }},
    {mlxd::ReduceOp::LogSumExp, [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::logsumexp(x, ax, k); }},
}};
static_assert(rows_follow_enum(kReduce), "kReduce: one row per ReduceOp, in the schema's order");

// Sums, products, scans and softmax of fp16/bf16 accumulate in fp32 as torch does: MLX's scans
// (and its reductions on some devices) keep the input precision, which drifts badly over long axes.
bool low_precision(const mx::array& x) { return x.dtype() == mx::float16 || x.dtype() == mx::bfloat16; }

template <typename F>
mx::array accumulate_fp32(const mx::array& x, F f) {
  if (!low_precision(x)) return f(x);
  return mx::astype(f(mx::astype(x, mx::float32)), x.dtype());
}

bool accumulates(mlxd::ReduceOp op) {
  return op == mlxd::ReduceOp::Sum || op == mlxd::ReduceOp::Mean || op == mlxd::ReduceOp::Prod ||
         op == mlxd::ReduceOp::LogSumExp;
}

// Empty axes mean "all axes", as in torch's dim=None.
std::vector<int> axes_or_all(const flatbuffers::Vector<int32_t>* v, int ndim) {
  std::vector<int> axes;
  if (v == nullptr || v->size() == 0) {
    axes.resize(ndim);
    std::iota(axes.begin(), axes.end(), 0);
  } else {
    for (int a : *v) axes.push_back(normalize_axis(a, ndim));
  }
  return axes;
}

// The CPU kernel's kind for op (sum, mean, max, min), or nullopt.
std::optional<ReduceKind> cpu_kind(mlxd::ReduceOp op) {
  switch (op) {
    case mlxd::ReduceOp::Sum: return ReduceKind::sum;
    case mlxd::ReduceOp::Mean: return ReduceKind::mean;
    case mlxd::ReduceOp::Max: return ReduceKind::max;
    case mlxd::ReduceOp::Min: return ReduceKind::min;
    default: return std::nullopt;
  }
}

}  // namespace

void exec_ReduceNode(const mlxd::ReduceNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto reduce = table_at(kReduce, n.op(), "reduce op");
  auto axes = axes_or_all(n.axes(), x.ndim());
  // Over adjacent axes on the CPU, the reduction kernel (sums in float64 for every input type).
  if (auto kind = cpu_kind(n.op()); kind && reduce_cpu_applies(x, axes))
    return ctx.set(n.out(), reduce_cpu(x, *kind, axes, n.keepdims()));
  auto run = [&](const mx::array& a) { return reduce(a, axes, n.keepdims()); };
  ctx.set(n.out(), accumulates(n.op()) ? accumulate_fp32(x, run) : run(x));
}

void exec_ArgReduceNode(const mlxd::ArgReduceNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  if (axis == x.ndim() - 1 && arg_rows_cpu_applies(x))
    return ctx.set(n.out(), arg_rows_cpu(x, n.op() == mlxd::ArgReduceOp::ArgMax, n.keepdims()));
  auto r = n.op() == mlxd::ArgReduceOp::ArgMax ? mx::argmax(x, axis, n.keepdims()) : mx::argmin(x, axis, n.keepdims());
  ctx.set(n.out(), mx::astype(r, mx::int64));
}

void exec_SoftmaxNode(const mlxd::SoftmaxNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  // Over the last axis the CPU row kernel (float32 math for every input type) replaces
  // MLX's single-threaded, scalar-exp softmax.
  if (axis == x.ndim() - 1 && rows_cpu_applies(x))
    return ctx.set(n.out(), rows_cpu(x, n.log() ? RowKernel::log_softmax : RowKernel::softmax));
  ctx.set(n.out(), accumulate_fp32(x, [&](const mx::array& a) {
    return n.log() ? mx::subtract(a, mx::logsumexp(a, {axis}, true)) : mx::softmax(a, {axis}, true);
  }));
}

void exec_VarNode(const mlxd::VarNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto axes = axes_or_all(n.axes(), x.ndim());
  // Divides by max(N - ddof, 0) like torch (inf or nan when nothing is left), where MLX clamps.
  double count = 1;
  for (int a : axes) count *= x.shape(a);
  double denom = std::max(count - n.ddof(), 0.0);
  // Its mean and sum of squares on the CPU reduction kernel where it takes the axes (the last ones).
  auto reduce = [&](const mx::array& a, ReduceKind kind, bool keep) {
    if (reduce_cpu_applies(a, axes)) return reduce_cpu(a, kind, axes, keep);
    return kind == ReduceKind::mean ? mx::mean(a, axes, keep) : mx::sum(a, axes, keep);
  };
  ctx.set(n.out(), accumulate_fp32(x, [&](const mx::array& a) {
    auto centered = mx::subtract(a, reduce(a, ReduceKind::mean, true));
    auto v = mx::divide(reduce(mx::square(centered), ReduceKind::sum, n.keepdims()), mx::array(denom, a.dtype()));
    return n.std() ? mx::sqrt(v) : v;
  }));
}

void exec_CumulativeNode(const mlxd::CumulativeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  bool rev = n.reverse();
  switch (n.op()) {
    case mlxd::ReduceOp::Sum:
      return ctx.set(n.out(), accumulate_fp32(x, [&](const mx::array& a) { return mx::cumsum(a, axis, rev, true); }));
    case mlxd::ReduceOp::Prod:
      return ctx.set(n.out(), accumulate_fp32(x, [&](const mx::array& a) { return mx::cumprod(a, axis, rev, true); }));
    case mlxd::ReduceOp::Max: return ctx.set(n.out(), mx::cummax(x, axis, rev, true));
    case mlxd::ReduceOp::Min: return ctx.set(n.out(), mx::cummin(x, axis, rev, true));
    default: throw NodeError("unsupported scan op");
  }
}

namespace {

// Stable argsort (equal keys keep index order; NaN sorts last ascending, first descending, as in
// torch). Descending sorts the reversed input ascending and maps the order back, which keeps ties
// in index order where negating the keys could not (ints overflow, bools do not negate).
mx::array stable_argsort(const mx::array& x, int axis, bool descending) {
  if (!descending) return mx::astype(mx::argsort(x, axis), mx::int64);
  int size = x.shape(axis);
  auto reversed = mx::arange(size - 1, -1, -1);
  auto order = mx::take(mx::argsort(mx::take(x, reversed, axis), axis), reversed, axis);
  return mx::subtract(mx::array(int64_t(size - 1), mx::int64), mx::astype(order, mx::int64));
}

mx::array slice_axis(const mx::array& x, int axis, int start, int stop) {
  mx::Shape lo(x.ndim(), 0), hi = x.shape();
  lo[axis] = start;
  hi[axis] = stop;
  return mx::slice(x, lo, hi);
}

// Writes the values and/or indices of a sort or top-k; a 0-d input is its own (only) entry.
void set_sorted(ExecContext& ctx, const mlxd::Tid* out_values, const mlxd::Tid* out_indices, const mx::array& x,
                const mx::array& indices, int axis) {
  bool scalar = x.ndim() == 0;
  if (out_values) ctx.set(out_values, scalar ? x : mx::take_along_axis(x, indices, axis));
  if (out_indices) ctx.set(out_indices, scalar ? mx::zeros({}, mx::int64) : indices);
}

}  // namespace

void exec_SortNode(const mlxd::SortNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  if (x.ndim() == 0) return set_sorted(ctx, n.out_values(), n.out_indices(), x, x, 0);
  int axis = normalize_axis(n.axis(), x.ndim());
  set_sorted(ctx, n.out_values(), n.out_indices(), x, stable_argsort(x, axis, n.descending()), axis);
}

void exec_TopkNode(const mlxd::TopkNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), std::max<int>(x.ndim(), 1));
  int size = x.ndim() == 0 ? 1 : x.shape(axis);
  int64_t k = ctx.resolve(n.k());
  if (k < 0 || k > size) throw NodeError("topk: k=" + std::to_string(k) + " out of range for size " + std::to_string(size));
  if (x.ndim() == 0) return set_sorted(ctx, n.out_values(), n.out_indices(), x, x, 0);
  auto indices = slice_axis(stable_argsort(x, axis, n.largest()), axis, 0, static_cast<int>(k));
  set_sorted(ctx, n.out_values(), n.out_indices(), x, indices, axis);
}

void exec_MedianNode(const mlxd::MedianNode& n, ExecContext& ctx) {
  const auto& in = ctx.in(n.x());
  auto x = n.flatten() ? mx::reshape(in, {-1}) : in;
  if (x.ndim() == 0) x = mx::reshape(x, {1});
  int axis = n.flatten() || in.ndim() == 0 ? 0 : normalize_axis(n.axis(), x.ndim());
  int size = x.shape(axis);
  if (size == 0) throw NodeError("median of an empty slice");
  // torch picks the lower median; a slice holding NaN has median NaN at its first NaN.
  auto index = slice_axis(stable_argsort(x, axis, false), axis, (size - 1) / 2, (size - 1) / 2 + 1);
  if (mx::issubdtype(x.dtype(), mx::floating)) {
    auto nan = mx::isnan(x);
    auto first_nan = mx::astype(mx::argmax(nan, axis, true), mx::int64);
    index = mx::where(mx::any(nan, {axis}, true), first_nan, index);
  }
  auto values = mx::take_along_axis(x, index, axis);
  auto shape_out = [&](const mx::array& a) {
    if (n.flatten()) return n.keepdims() ? mx::reshape(a, mx::Shape(in.ndim(), 1)) : mx::reshape(a, {});
    if (in.ndim() == 0) return mx::reshape(a, {});
    return n.keepdims() ? a : mx::squeeze(a, axis);
  };
  if (n.out_values()) ctx.set(n.out_values(), shape_out(values));
  if (n.out_indices()) ctx.set(n.out_indices(), shape_out(index));
}

}  // namespace mlxd::rt
