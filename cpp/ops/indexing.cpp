// Gathers and scatters: take (embedding, index_select), take_along_axis
// (gather), torch advanced indexing (index.Tensor / index_put), scatter along
// an axis (scatter, scatter_add, scatter_reduce) and slice updates.
#include <algorithm>
#include <array>
#include <numeric>

#include "../ops_common.h"

namespace mlxd::rt {
namespace {

using ScatterFn = mx::array (*)(const mx::array&, const std::vector<mx::array>&, const mx::array&,
                                const std::vector<int>&, mx::StreamOrDevice);

// One row per `enum ScatterMode` value, keyed by it (checked at compile time).
constexpr std::array<OpRow<mlxd::ScatterMode, ScatterFn>, enum_size<mlxd::ScatterMode>()> kScatter = {{
    {mlxd::ScatterMode::Set, [](const mx::array& a, const std::vector<mx::array>& i, const mx::array& u, const std::vector<int>& ax, mx::StreamOrDevice s) {
      return mx::scatter(a, i, u, ax, s);
    }},
    {mlxd::ScatterMode::Add, [](const mx::array& a, const std::vector<mx::array>& i, const mx::array& u, const std::vector<int>& ax, mx::StreamOrDevice s) {
      return mx::scatter_add(a, i, u, ax, s);
    }},
    {mlxd::ScatterMode::Prod, [](const mx::array& a, const std::vector<mx::array>& i, const mx::array& u, const std::vector<int>& ax, mx::StreamOrDevice s) {
      return mx::scatter_prod(a, i, u, ax, s);
    }},
    {mlxd::ScatterMode::Max, [](const mx::array& a, const std::vector<mx::array>& i, const mx::array& u, const std::vector<int>& ax, mx::StreamOrDevice s) {
      return mx::scatter_max(a, i, u, ax, s);
    }},
    {mlxd::ScatterMode::Min, [](const mx::array& a, const std::vector<mx::array>& i, const mx::array& u, const std::vector<int>& ax, mx::StreamOrDevice s) {
      return mx::scatter_min(a, i, u, ax, s);
    }},
}};
static_assert(rows_follow_enum(kScatter), "kScatter: one row per ScatterMode, in the schema's order");

// MLX's GPU scatter kernels (Metal and CUDA) reject 64-bit integers ("GPU scatter does not yet support
// int64"; MoE routing counts are int64): those scatters run on the CPU stream, which reads the same
// buffers (unified memory on Metal, managed on CUDA).
mx::StreamOrDevice scatter_stream(mx::Dtype t) {
  bool wide_int = t == mx::int64 || t == mx::uint64;
  if (wide_int && mx::default_device() != mx::Device::cpu) return mx::Device(mx::Device::cpu);
  return {};
}

// torch wraps negative indices in advanced indexing; MLX's kernels happen to
// as well, but that is not part of its API, so wrap explicitly.
mx::array wrap_negative(const mx::array& idx, int size) {
  if (!mx::issubdtype(idx.dtype(), mx::signedinteger)) return idx;
  auto neg = mx::less(idx, mx::array(0, idx.dtype()));
  return mx::where(neg, mx::add(idx, mx::array(size, idx.dtype())), idx);
}

// torch advanced indexing, x[..., i0, ..., i1, ...]: the index arrays
// broadcast to `shape`; those dims replace the indexed axes in place when the
// axes are consecutive and lead the result otherwise (`insert_at`).
struct AdvancedIndex {
  std::vector<mx::array> indices;
  std::vector<int> axes;
  mx::Shape shape;
  int insert_at = 0;
};

AdvancedIndex advanced_index(const mx::array& x, const flatbuffers::Vector<const mlxd::Tid*>* tids,
                             const flatbuffers::Vector<int32_t>* axes, ExecContext& ctx) {
  AdvancedIndex ai;
  ai.axes = int_vector(axes);
  if (tids == nullptr || tids->size() == 0 || tids->size() != ai.axes.size())
    throw NodeError("needs one index array per axis, at least one");
  for (size_t i = 0; i < ai.axes.size(); ++i) {
    ai.axes[i] = normalize_axis(ai.axes[i], x.ndim());
    if (i > 0 && ai.axes[i] <= ai.axes[i - 1]) throw NodeError("indexed axes must be increasing");
    ai.indices.push_back(wrap_negative(ctx.in(tids->Get(i)), x.shape(ai.axes[i])));
  }
  ai.indices = mx::broadcast_arrays(ai.indices);
  ai.shape = ai.indices[0].shape();
  bool consecutive = ai.axes.back() - ai.axes.front() + 1 == static_cast<int>(ai.axes.size());
  ai.insert_at = consecutive ? ai.axes.front() : 0;
  return ai;
}

// Permutation moving `count` dims at `from` to position `to` (all other dims keep their order).
std::vector<int> move_block(int ndim, int from, int count, int to) {
  std::vector<int> rest, perm;
  for (int i = 0; i < ndim; ++i)
    if (i < from || i >= from + count) rest.push_back(i);
  perm.insert(perm.end(), rest.begin(), rest.begin() + to);
  for (int i = 0; i < count; ++i) perm.push_back(from + i);
  perm.insert(perm.end(), rest.begin() + to, rest.end());
  return perm;
}

// The trailing "slice" dims of gather/scatter: x's shape with indexed axes cut to 1.
mx::Shape slice_sizes(const mx::array& x, const std::vector<int>& axes) {
  mx::Shape s = x.shape();
  for (int a : axes) s[a] = 1;
  return s;
}

// Positions of the slice's unit dims inside gather/scatter's (index dims + x dims) layout.
std::vector<int> unit_dims(const AdvancedIndex& ai) {
  std::vector<int> out;
  for (int a : ai.axes) out.push_back(static_cast<int>(ai.shape.size()) + a);
  return out;
}

// Index arrays addressing every element of an `shape`-shaped index along all
// axes: `along` itself on `axis`, broadcast iotas elsewhere (torch.scatter's walk).
std::vector<mx::array> axis_indices(const mx::array& along, int axis) {
  std::vector<mx::array> out;
  int ndim = along.ndim();
  for (int d = 0; d < ndim; ++d) {
    if (d == axis) {
      out.push_back(along);
      continue;
    }
    mx::Shape s(ndim, 1);
    s[d] = along.shape(d);
    out.push_back(mx::reshape(mx::arange(along.shape(d), mx::int32), s));
  }
  return out;
}

// Python-style clamp of a slice bound into [0, size].
int64_t clamp_bound(int64_t v, int64_t size) {
  if (v < 0) v += size;
  return std::clamp<int64_t>(v, 0, size);
}

}  // namespace

void exec_TakeNode(const mlxd::TakeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  ctx.set(n.out(), mx::take(x, ctx.in(n.indices()), normalize_axis(n.axis(), x.ndim())));
}

void exec_TakeAlongAxisNode(const mlxd::TakeAlongAxisNode& n, ExecContext& ctx) {
  mx::array x = ctx.in(n.x());
  const auto& idx = ctx.in(n.indices());
  int axis = normalize_axis(n.axis(), x.ndim());
  // torch.gather allows an index smaller than x on the other axes: only the
  // leading part of x takes part (MLX would broadcast instead).
  if (idx.ndim() == x.ndim()) {
    mx::Shape stop = x.shape();
    bool cut = false;
    for (int d = 0; d < x.ndim(); ++d)
      if (d != axis && idx.shape(d) < x.shape(d)) stop[d] = idx.shape(d), cut = true;
    if (cut) x = mx::slice(x, mx::Shape(x.ndim(), 0), stop);
  }
  ctx.set(n.out(), mx::take_along_axis(x, idx, axis));
}

void exec_GatherNode(const mlxd::GatherNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto ai = advanced_index(x, n.indices(), n.axes(), ctx);
  auto out = mx::squeeze(mx::gather(x, ai.indices, ai.axes, slice_sizes(x, ai.axes)), unit_dims(ai));
  int nb = static_cast<int>(ai.shape.size());
  if (ai.insert_at > 0) out = mx::transpose(out, move_block(out.ndim(), 0, nb, ai.insert_at));
  ctx.set(n.out(), out);
}

void exec_ScatterNode(const mlxd::ScatterNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto ai = advanced_index(x, n.indices(), n.axes(), ctx);
  int nb = static_cast<int>(ai.shape.size());
  // Broadcast the updates to x[indices]'s torch layout, then bring them to
  // MLX's (index dims, then x's dims with unit indexed axes).
  mx::Shape result;
  for (int d = 0; d < x.ndim(); ++d)
    if (std::find(ai.axes.begin(), ai.axes.end(), d) == ai.axes.end()) result.push_back(x.shape(d));
  result.insert(result.begin() + ai.insert_at, ai.shape.begin(), ai.shape.end());
  auto updates = mx::broadcast_to(mx::astype(ctx.in(n.updates()), x.dtype()), result);
  if (ai.insert_at > 0) updates = mx::transpose(updates, move_block(updates.ndim(), ai.insert_at, nb, 0));
  updates = mx::expand_dims(updates, unit_dims(ai));
  ctx.set(n.out(), table_at(kScatter, n.mode(), "scatter mode")(x, ai.indices, updates, ai.axes, scatter_stream(x.dtype())));
}

void exec_ScatterAxisNode(const mlxd::ScatterAxisNode& n, ExecContext& ctx) {
  mx::array x = ctx.in(n.x());
  const auto& idx = ctx.in(n.indices());
  if (idx.ndim() != x.ndim() || x.ndim() == 0) throw NodeError("index must have x's rank (at least 1)");
  int axis = normalize_axis(n.axis(), x.ndim());
  mx::array updates = mx::astype(ctx.in(n.updates()), x.dtype());
  // torch only reads the part of src that the index covers.
  if (updates.ndim() == idx.ndim()) {
    mx::Shape stop = updates.shape();
    for (int d = 0; d < idx.ndim(); ++d) stop[d] = std::min(stop[d], idx.shape(d));
    updates = mx::slice(updates, mx::Shape(idx.ndim(), 0), stop);
  }
  updates = mx::broadcast_to(updates, idx.shape());
  mx::Shape expanded = idx.shape();
  expanded.insert(expanded.end(), idx.ndim(), 1);
  updates = mx::reshape(updates, expanded);
  auto indices = axis_indices(idx, axis);
  std::vector<int> axes(x.ndim());
  std::iota(axes.begin(), axes.end(), 0);
  auto mode = n.mode();
  if (!n.include_self() && mode != mlxd::ScatterMode::Set) {
    // Reset the targets to the reduction's identity (max/min: to one of the
    // updates, which is one for any dtype) so that x's values drop out.
    mx::array init = updates;
    if (mode == mlxd::ScatterMode::Add) init = mx::zeros_like(updates);
    if (mode == mlxd::ScatterMode::Prod) init = mx::ones_like(updates);
    x = mx::scatter(x, indices, init, axes, scatter_stream(x.dtype()));
  }
  ctx.set(n.out(), table_at(kScatter, mode, "scatter mode")(x, indices, updates, axes, scatter_stream(x.dtype())));
}

void exec_SliceUpdateNode(const mlxd::SliceUpdateNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto update = mx::astype(ctx.in(n.update()), x.dtype());
  int axis = normalize_axis(n.axis(), x.ndim());
  int64_t size = x.shape(axis), step = n.step();
  if (step <= 0) throw NodeError("slice step must be positive");
  if (update.ndim() != x.ndim()) throw NodeError("update must have x's rank");
  int64_t start = clamp_bound(ctx.resolve(n.start()), size);
  int64_t stop;
  if (n.stop() != nullptr) {
    stop = std::max(clamp_bound(ctx.resolve(n.stop()), size), start);
  } else {  // as long as the update along axis
    int64_t len = update.shape(axis);
    stop = len == 0 ? start : std::min(size, start + (len - 1) * step + 1);
  }
  mx::Shape lo(x.ndim(), 0), hi = x.shape(), st(x.ndim(), 1);
  lo[axis] = static_cast<int>(start);
  hi[axis] = static_cast<int>(stop);
  st[axis] = static_cast<int>(step);
  int64_t count = (stop - start + step - 1) / step;
  if (update.shape(axis) != count)
    throw NodeError("update has " + std::to_string(update.shape(axis)) + " entries along the axis, slice has " +
                    std::to_string(count));
  ctx.set(n.out(), mx::slice_update(x, update, lo, hi, st));
}

// The start stays an array so the node's graph is the same for every position.
// MLX does not bound-check a dynamic start, so it is clamped here: a write
// past the end lands on the last `length` entries instead of outside x.
void exec_DynamicSliceUpdateNode(const mlxd::DynamicSliceUpdateNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto update = mx::astype(ctx.in(n.update()), x.dtype());
  const auto& start = ctx.in(n.start());
  if (update.ndim() != x.ndim()) throw NodeError("update must have x's rank");
  int axis = normalize_axis(n.axis(), x.ndim());
  for (int d = 0; d < x.ndim(); ++d)
    if (d != axis ? update.shape(d) != x.shape(d) : update.shape(d) > x.shape(d))
      throw NodeError("update does not fit x outside the written axis, or is longer than x along it");
  if (start.size() != 1 || !mx::issubdtype(start.dtype(), mx::integer))
    throw NodeError("start must be a one-element integer tensor");
  int last = x.shape(axis) - update.shape(axis);
  ctx.guard_index(n.start(), 0, last, "slice update start");
  // Still clamped: a start computed inside the graph cannot be checked on the host.
  auto at = mx::clip(mx::reshape(mx::astype(start, mx::int32), {1}), mx::array(0, mx::int32),
                     mx::array(last, mx::int32));
  ctx.set(n.out(), mx::slice_update(x, update, at, {axis}));
}

}  // namespace mlxd::rt
