// Shape and layout: reshape, transpose, broadcast, slicing, concat, split,
// tile, roll, flip and padding.
#include <algorithm>
#include <array>
#include <limits>
#include <cstring>
#include <vector>

#include <mlx/primitives.h>

#include "../ops_common.h"

namespace mlxd::rt {

namespace {

// By name: libmlx exports no type info for its primitives.
bool is_reshape_view(const mx::array& x) {
  if (!x.has_primitive()) return false;
  const char* name = x.primitive().name();
  return std::strcmp(name, "Reshape") == 0 || std::strcmp(name, "ExpandDims") == 0 ||
         std::strcmp(name, "Squeeze") == 0;
}

// x reshaped to `shape`, looking through the reshapes that produced x: a chain
// of views (view -> transpose of unit axes -> view, as attention does around a
// one-token step) becomes one reshape, or none when the shape comes back.
// Every graph node costs a few microseconds of dispatch however little it does.
mx::array reshaped(mx::array x, const mx::Shape& shape) {
  while (is_reshape_view(x)) x = x.inputs()[0];
  if (x.shape() == shape) return x;
  return mx::reshape(x, shape);
}

// Whether `perm` moves only size-1 axes: the others keep their order, so the
// transpose is a reshape.
bool moves_only_unit_axes(const mx::array& x, const std::vector<int>& perm) {
  if (perm.size() != static_cast<size_t>(x.ndim())) return false;
  std::vector<bool> seen(perm.size());
  for (int a : perm) {
    if (seen[a]) return false;  // not a permutation: mx::transpose names it
    seen[a] = true;
  }
  int last = -1;
  for (int a : perm) {
    if (x.shape(a) == 1) continue;
    if (a < last) return false;
    last = a;
  }
  return true;
}

}  // namespace

void exec_ReshapeNode(const mlxd::ReshapeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  mx::Shape shape = ctx.resolve_shape(n.shape());
  // Resolves a -1 and checks the size the way MLX does before looking through views.
  if (std::find(shape.begin(), shape.end(), -1) != shape.end()) shape = mx::reshape(x, shape).shape();
  int64_t size = 1;
  for (auto d : shape) size *= d;
  if (size != static_cast<int64_t>(x.size())) {
    ctx.set(n.out(), mx::reshape(x, shape));  // MLX names the mismatch
    return;
  }
  ctx.set(n.out(), reshaped(x, shape));
}

void exec_TransposeNode(const mlxd::TransposeNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  std::vector<int> perm;
  for (int a : int_vector(n.perm())) perm.push_back(normalize_axis(a, x.ndim()));
  // Constants keep a real transpose view: kernels recognise a transposed
  // weight by it (and it is no per-call cost outside a compiled graph's input).
  if (!x.is_available() && moves_only_unit_axes(x, perm)) {
    mx::Shape shape;
    for (int a : perm) shape.push_back(x.shape(a));
    ctx.set(n.out(), reshaped(x, shape));
    return;
  }
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

void exec_TileNode(const mlxd::TileNode& n, ExecContext& ctx) {
  ctx.set(n.out(), mx::tile(ctx.in(n.x()), int_vector(n.reps())));
}

void exec_RollNode(const mlxd::RollNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  auto shifts = int_vector(n.shifts());
  mx::Shape shift(shifts.begin(), shifts.end());
  if (!n.axes() || n.axes()->size() == 0) {
    if (shift.size() != 1) throw NodeError("roll without axes takes one shift");
    return ctx.set(n.out(), mx::roll(x, shift[0]));
  }
  std::vector<int> axes;
  for (int a : int_vector(n.axes())) axes.push_back(normalize_axis(a, x.ndim()));
  if (axes.size() != shift.size()) throw NodeError("roll needs one shift per axis");
  ctx.set(n.out(), mx::roll(x, shift, axes));
}

void exec_FlipNode(const mlxd::FlipNode& n, ExecContext& ctx) {
  const auto& x = ctx.in(n.x());
  mx::Shape lo(x.ndim(), 0), hi = x.shape(), st(x.ndim(), 1);
  for (int a : int_vector(n.axes())) {
    int axis = normalize_axis(a, x.ndim());
    // A negative stride walks from the last element down past the first.
    lo[axis] = x.shape(axis) - 1;
    hi[axis] = -x.shape(axis) - 1;
    st[axis] = -1;
  }
  ctx.set(n.out(), mx::slice(x, lo, hi, st));
}

namespace {
// MLX's names for the schema's pad modes.
constexpr std::array<OpRow<mlxd::PadMode, const char*>, enum_size<mlxd::PadMode>()> kPadMode = {{
    {mlxd::PadMode::Constant, "constant"},
    {mlxd::PadMode::Reflect, "reflect"},
    {mlxd::PadMode::Replicate, "edge"},
}};
static_assert(rows_follow_enum(kPadMode), "kPadMode: one row per PadMode, in the schema's order");
}  // namespace

void exec_PadNode(const mlxd::PadNode& n, ExecContext& ctx) {
  mx::array x = ctx.in(n.x());
  const char* mode = table_at(kPadMode, n.mode(), "pad mode");
  bool constant = n.mode() == mlxd::PadMode::Constant;
  const auto* pads = n.pads();
  if (!pads || pads->size() % 2 != 0 || static_cast<int>(pads->size() / 2) > x.ndim())
    throw NodeError("pad needs (low, high) pairs for at most ndim axes");
  std::vector<int> axes;
  mx::Shape low, high;
  for (int i = 0; i < static_cast<int>(pads->size() / 2); ++i) {
    int axis = x.ndim() - 1 - i;
    int64_t lo = ctx.resolve(pads->Get(2 * i)), hi = ctx.resolve(pads->Get(2 * i + 1)), size = x.shape(axis);
    if (lo < 0 || hi < 0) {
      // constant_pad_nd crops on negative pads; the border-reading modes have no such meaning.
      if (!constant) throw NodeError(std::string("negative padding in ") + mode + " mode");
      int64_t start = std::max<int64_t>(-lo, 0), stop = size - std::max<int64_t>(-hi, 0);
      if (stop < start) throw NodeError("negative padding crops more than the dimension holds");
      mx::Shape b(x.ndim(), 0), e = x.shape();
      b[axis] = static_cast<int>(start);
      e[axis] = static_cast<int>(stop);
      x = mx::slice(x, b, e);
    }
    lo = std::max<int64_t>(lo, 0);
    hi = std::max<int64_t>(hi, 0);
    if (n.mode() == mlxd::PadMode::Reflect && (lo >= size || hi >= size))
      throw NodeError("reflect padding must be smaller than the dimension");
    if (n.mode() == mlxd::PadMode::Replicate && size == 0 && lo + hi > 0)
      throw NodeError("replicate padding of an empty dimension");
    axes.push_back(axis);
    low.push_back(static_cast<int>(lo));
    high.push_back(static_cast<int>(hi));
  }
  double value = n.value() ? ctx.resolve(n.value()) : 0.0;
  ctx.set(n.out(), mx::pad(x, axes, low, high, mx::array(value, x.dtype()), mode));
}

}  // namespace mlxd::rt
