// Shape and layout: reshape, transpose, broadcast, slicing, concat, split.
#include <algorithm>
#include <limits>

#include "../ops_common.h"

namespace mlxd::rt {

void exec_ReshapeNode(const mlxd::ReshapeNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::reshape(ctx.in(n.x()), ctx.resolve_shape(n.shape())));
}

void exec_TransposeNode(const mlxd::TransposeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  std::vector<int> perm;
  for (int a : int_vector(n.perm())) perm.push_back(normalize_axis(a, x.ndim()));
  ctx.set(n.out(), mx::transpose(x, perm));
}

void exec_BroadcastNode(const mlxd::BroadcastNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  mx::Shape shape = ctx.resolve_shape(n.shape());
  // -1 keeps the input's size (torch.expand), aligned from the right.
  int offset = static_cast<int>(shape.size()) - x.ndim();
  for (int i = 0; i < static_cast<int>(shape.size()); ++i)
    if (shape[i] == -1) {
      if (i < offset) throw NodeError("-1 in a new leading broadcast dimension");
      shape[i] = x.shape(i - offset);
    }
  ctx.set(n.out(), mx::broadcast_to(x, shape));
}

void exec_ExpandDimsNode(const mlxd::ExpandDimsNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::expand_dims(ctx.in(n.x()), int_vector(n.axes())));
}

void exec_SqueezeNode(const mlxd::SqueezeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  std::vector<int> axes;
  // torch.squeeze(dim) leaves dimensions that are not 1 alone.
  for (int a : int_vector(n.axes())) {
    int ax = normalize_axis(a, x.ndim());
    if (x.ndim() > 0 && x.shape(ax) == 1) axes.push_back(ax);
  }
  ctx.set(n.out(), axes.empty() ? x : mx::squeeze(x, axes));
}

void exec_SliceNode(const mlxd::SliceNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  int64_t size = x.shape(axis), step = n.step();
  if (step <= 0) throw NodeError("slice step must be positive");
  auto clamp = [&](int64_t v) {
    if (v < 0) v += size;
    return std::clamp<int64_t>(v, 0, size);
  };
  int64_t start = clamp(ctx.resolve(n.start())), stop = clamp(ctx.resolve(n.stop()));
  stop = std::max(stop, start);
  mx::Shape lo(x.ndim(), 0), hi = x.shape(), st(x.ndim(), 1);
  lo[axis] = static_cast<int>(start);
  hi[axis] = static_cast<int>(stop);
  st[axis] = static_cast<int>(step);
  ctx.set(n.out(), mx::slice(x, lo, hi, st));
}

void exec_SelectNode(const mlxd::SelectNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  int64_t size = x.shape(axis), index = ctx.resolve(n.index());
  if (index < -size || index >= size)
    throw NodeError("index " + std::to_string(index) + " out of range for size " + std::to_string(size));
  if (index < 0) index += size;
  mx::Shape lo(x.ndim(), 0), hi = x.shape();
  lo[axis] = static_cast<int>(index);
  hi[axis] = static_cast<int>(index + 1);
  ctx.set(n.out(), mx::squeeze(mx::slice(x, lo, hi), axis));
}

namespace {
std::vector<mx::array> gather_inputs(const flatbuffers::Vector<const mlxd::Tid*>* xs, ExecContext& ctx) {
  std::vector<mx::array> out;
  if (xs == nullptr || xs->size() == 0) throw NodeError("needs at least one input");
  for (const auto* t : *xs) out.push_back(ctx.in(t));
  return out;
}
}  // namespace

void exec_ConcatNode(const mlxd::ConcatNode& n, ExecContext& ctx) {
  auto xs = gather_inputs(n.xs(), ctx);
  ctx.set(n.out(), mx::concatenate(xs, normalize_axis(n.axis(), xs[0].ndim())));
}

void exec_StackNode(const mlxd::StackNode& n, ExecContext& ctx) {
  auto xs = gather_inputs(n.xs(), ctx);
  ctx.set(n.out(), mx::stack(xs, normalize_axis(n.axis(), xs[0].ndim() + 1)));
}

void exec_SplitNode(const mlxd::SplitNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  int axis = normalize_axis(n.axis(), x.ndim());
  if (!n.sizes() || !n.outs() || n.sizes()->size() != n.outs()->size())
    throw NodeError("split needs one size per output");
  int64_t start = 0;
  for (size_t i = 0; i < n.sizes()->size(); ++i) {
    int64_t len = ctx.resolve(n.sizes()->Get(i));
    mx::Shape lo(x.ndim(), 0), hi = x.shape();
    lo[axis] = static_cast<int>(std::min<int64_t>(start, x.shape(axis)));
    hi[axis] = static_cast<int>(std::min<int64_t>(start + len, x.shape(axis)));
    ctx.set(n.outs()->Get(i), mx::slice(x, lo, hi));
    start += len;
  }
}

void exec_IdentityNode(const mlxd::IdentityNode& n, ExecContext& ctx) { ctx.set(n.out(), ctx.in(n.x())); }

void exec_AsTypeNode(const mlxd::AsTypeNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::astype(ctx.in(n.x()), to_mlx(n.dtype())));
}

}  // namespace mlxd::rt
