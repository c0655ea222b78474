// Reductions, arg-reductions, softmax, variance and scans.
#include <array>
#include <numeric>

#include "../ops_common.h"

namespace mlxd::rt {
namespace {

using Reduce = mx::array (*)(const mx::array&, const std::vector<int>&, bool);

// Rows follow `enum ReduceOp` in the schema.
const std::array<Reduce, static_cast<size_t>(mlxd::ReduceOp::MAX) + 1> kReduce = {
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::sum(x, ax, k); },
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::mean(x, ax, k); },
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::max(x, ax, k); },
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::min(x, ax, k); },
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::prod(x, ax, k); },
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::any(x, ax, k); },
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::all(x, ax, k); },
    [](const mx::array& x, const std::vector<int>& ax, bool k) { return mx::logsumexp(x, ax, k); },
};

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

}  // namespace

void exec_ReduceNode(const mlxd::ReduceNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  ctx.set(n.out(), table_at(kReduce, n.op(), "reduce op")(x, axes_or_all(n.axes(), x.ndim()), n.keepdims()));
}

void exec_ArgReduceNode(const mlxd::ArgReduceNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  auto r = n.op() == mlxd::ArgReduceOp::ArgMax ? mx::argmax(x, axis, n.keepdims()) : mx::argmin(x, axis, n.keepdims());
  ctx.set(n.out(), mx::astype(r, mx::int64));
}

void exec_SoftmaxNode(const mlxd::SoftmaxNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  ctx.set(n.out(), n.log() ? mx::subtract(x, mx::logsumexp(x, {axis}, true)) : mx::softmax(x, {axis}, true));
}

void exec_VarNode(const mlxd::VarNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto axes = axes_or_all(n.axes(), x.ndim());
  ctx.set(n.out(), n.std() ? mx::std(x, axes, n.keepdims(), n.ddof()) : mx::var(x, axes, n.keepdims(), n.ddof()));
}

void exec_CumulativeNode(const mlxd::CumulativeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  bool rev = n.reverse();
  switch (n.op()) {
    case mlxd::ReduceOp::Sum: return ctx.set(n.out(), mx::cumsum(x, axis, rev, true));
    case mlxd::ReduceOp::Prod: return ctx.set(n.out(), mx::cumprod(x, axis, rev, true));
    case mlxd::ReduceOp::Max: return ctx.set(n.out(), mx::cummax(x, axis, rev, true));
    case mlxd::ReduceOp::Min: return ctx.set(n.out(), mx::cummin(x, axis, rev, true));
    default: throw NodeError("unsupported scan op");
  }
}

}  // namespace mlxd::rt
