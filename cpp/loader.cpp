#include "loader.h"

#include "kernels/cpu_parallel.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#include <executorch/runtime/core/freeable_buffer.h>
#include <mlx/allocator.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace mlxd::rt {
namespace {

constexpr uint32_t kMaxSlots = 1u << 24;
constexpr int kMaxRank = 16;

[[noreturn]] void fail(const std::string& msg) { throw LoadError(msg); }

size_t dtype_size(mlxd::DType d) { return to_mlx(d).size(); }

// Element count of a shape, rejecting negative sizes and overflow.
size_t checked_numel(const flatbuffers::Vector<int64_t>* shape, const std::string& what) {
  size_t n = 1;
  if (shape == nullptr) return n;
  if (shape->size() > kMaxRank) fail(what + ": rank " + std::to_string(shape->size()) + " too large");
  for (int64_t d : *shape) {
    if (d < 0 || d > std::numeric_limits<int32_t>::max()) fail(what + ": bad dimension " + std::to_string(d));
    if (d != 0 && n > std::numeric_limits<size_t>::max() / static_cast<size_t>(d)) fail(what + ": size overflows");
    n *= static_cast<size_t>(d);
  }
  return n;
}

void check_dtype(mlxd::DType d, const std::string& what) {
  if (d < mlxd::DType::MIN || d > mlxd::DType::MAX) fail(what + ": unknown dtype " + std::to_string(int(d)));
}

mx::Shape to_shape(const flatbuffers::Vector<int64_t>* shape) {
  mx::Shape s;
  if (shape) for (int64_t d : *shape) s.push_back(static_cast<int>(d));
  return s;
}

std::atomic<bool> g_huge_pages{[] {
  const char* v = std::getenv("MLX_DELEGATE_HUGE_PAGES");
  return !(v && std::strcmp(v, "0") == 0);
}()};

// Off: only constants of 4 MiB and more get huge-page memory, each its own (for A/B runs).
std::atomic<bool> g_constant_arena{[] {
  const char* v = std::getenv("MLX_DELEGATE_CONSTANT_ARENA");
  return !(v && std::strcmp(v, "0") == 0);
}()};

constexpr size_t kHugePage = size_t{2} << 20;
#if defined(MADV_COLLAPSE)
constexpr int kMadvCollapse = MADV_COLLAPSE;
#else
constexpr int kMadvCollapse = 25;  // Linux's value; older headers lack it
#endif

// Whether constants go to huge-page-advised memory: Linux, the CPU as MLX's device, switched on.
bool huge_pages_apply() {
#if defined(__linux__)
  return g_huge_pages.load(std::memory_order_relaxed) && mx::default_device() == mx::Device::cpu;
#else
  return false;
#endif
}

// MLX memory of `bytes` whose whole 2 MiB pages are advised for transparent huge pages before `fill`
// writes it, so the writes' page faults take huge pages where the kernel has them; memory that malloc
// reused (faulted in 4 KiB pages before the advice) is collapsed afterwards (Linux 6.1+; an older
// kernel refuses, and it stays in 4 KiB pages). On the CPU MLX's array(ptr, ..., deleter) constructor
// copies into its allocator anyway (it has no no-copy path there), so this costs no second copy.
template <typename Fill>
std::optional<mx::allocator::Data> huge_page_memory(size_t bytes, Fill&& fill) {
#if defined(__linux__)
  auto data = mx::allocator::malloc(bytes);
  auto* dst = static_cast<char*>(data.buffer().raw_ptr());
  if (dst == nullptr) return std::nullopt;
  const auto begin = reinterpret_cast<uintptr_t>(dst), end = begin + bytes;
  const uintptr_t first = (begin + kHugePage - 1) / kHugePage * kHugePage, last = end / kHugePage * kHugePage;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice only
  fill(dst);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, kMadvCollapse);
  return data;
#else
  (void)bytes, (void)fill;
  return std::nullopt;
#endif
}

// One tensor of `bytes` from `src` in huge-page memory; nullopt where that does not apply (small, not
// the CPU, not Linux, switched off): the caller then hands the data to MLX as before.
std::optional<mx::array> huge_page_copy(const void* src, size_t bytes, const mx::Shape& shape, mx::Dtype dtype) {
  if (!huge_pages_apply() || bytes < 2 * kHugePage) return std::nullopt;
  auto data = huge_page_memory(bytes, [&](char* dst) { std::memcpy(dst, src, bytes); });
  if (!data) return std::nullopt;
  return mx::array(std::move(*data), shape, dtype);
}

// Checked named data of `numel` elements of `dtype`.
executorch::runtime::FreeableBuffer get_named(const executorch::runtime::NamedDataMap* map,
                                              const flatbuffers::String* key, mlxd::DType dtype,
                                              const flatbuffers::Vector<int64_t>* shape, const std::string& what) {
  if (key == nullptr) fail(what + ": missing data key");
  if (map == nullptr) fail(what + ": program has no named data map");
  size_t numel = checked_numel(shape, what);
  if (numel > std::numeric_limits<size_t>::max() / dtype_size(dtype)) fail(what + ": size overflows");
  size_t expected = numel * dtype_size(dtype);
  auto data = map->get_data(std::string_view(key->c_str(), key->size()));
  if (!data.ok()) fail(what + ": named data '" + payload_name(key) + "' not found");
  if (data->size() != expected)
    fail(what + ": named data '" + payload_name(key) + "' has " + std::to_string(data->size()) + " bytes, expected " +
         std::to_string(expected));
  return std::move(data.get());
}

// Named data in an MLX array (see huge_page_copy); the FreeableBuffer is released when MLX no longer
// needs the memory.
mx::array load_named(const executorch::runtime::NamedDataMap* map, const flatbuffers::String* key,
                     mlxd::DType dtype, const flatbuffers::Vector<int64_t>* shape, const std::string& what) {
  auto data = get_named(map, key, dtype, shape, what);
  if (auto copy = huge_page_copy(data.data(), data.size(), to_shape(shape), to_mlx(dtype))) {
    data.Free();  // the data map's buffer (a file mapping) is no longer needed
    return *copy;
  }
  auto* owned = new executorch::runtime::FreeableBuffer(std::move(data));
  void* ptr = const_cast<void*>(owned->data());
  return mx::array(ptr, to_shape(shape), to_mlx(dtype), [owned](void*) {
    owned->Free();
    delete owned;
  });
}

// All of a method's constants copied into one huge-page arena, each an MLX array viewing its slice:
// a decode step streams every weight, and the small ones (q/k/v, o, scales and biases) together are a
// third of a quantized model, too small one by one for whole huge pages. Each view's deleter holds the
// arena, so it lives while any constant does. nullopt where huge pages do not apply or the constants
// are too small to fill one.
constexpr size_t kArenaAlign = 64;  // a cache line: the CPU kernels' vector loads stay aligned
std::optional<std::vector<mx::array>> load_arena(const executorch::runtime::NamedDataMap* map,
                                                 const flatbuffers::Vector<flatbuffers::Offset<mlxd::Constant>>& cs) {
  if (!huge_pages_apply() || !g_constant_arena.load(std::memory_order_relaxed)) return std::nullopt;
  // Sizes from the shapes; each source is fetched, copied and freed in turn, because a data map may
  // hold what it returns resident (the stock runtime's file loader mlocks its mappings): fetching all
  // first would hold the weights twice.
  std::vector<size_t> offset;
  size_t total = 0;
  for (const auto* c : cs) {
    std::string what = "constant '" + payload_name(c->name()) + "'";
    check_dtype(c->dtype(), what);
    size_t numel = checked_numel(c->shape(), what);
    if (numel > std::numeric_limits<size_t>::max() / dtype_size(c->dtype()) / 2) fail(what + ": size overflows");
    const size_t bytes = (numel * dtype_size(c->dtype()) + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
    if (bytes > std::numeric_limits<size_t>::max() - total) fail(what + ": constants' total size overflows");
    offset.push_back(total);
    total += bytes;
  }
  if (total < 2 * kHugePage) return std::nullopt;
  auto data = huge_page_memory(total, [&](char* dst) {
    for (size_t i = 0; i < cs.size(); ++i) {
      const auto* c = cs.Get(i);
      auto src = get_named(map, c->key(), c->dtype(), c->shape(), "constant '" + payload_name(c->name()) + "'");
      if (src.size()) std::memcpy(dst + offset[i], src.data(), src.size());
      src.Free();  // the data map's buffer (a file mapping) is no longer needed
    }
  });
  if (!data) return std::nullopt;
  cpu_kernel_note_call("constant_arena");  // tests prove the arena was built
  auto arena = std::make_shared<mx::allocator::Data>(std::move(*data));
  const mx::allocator::Buffer buf = arena->buffer();
  std::vector<mx::array> out;
  out.reserve(cs.size());
  for (size_t i = 0; i < cs.size(); ++i) {
    const auto* c = cs.Get(i);
    auto keep = [arena](mx::allocator::Buffer) {};
    mx::array a(mx::allocator::Data(buf, keep), to_shape(c->shape()), to_mlx(c->dtype()));
    a.set_data(mx::allocator::Data(buf, keep), a.size(), a.strides(), a.flags(), static_cast<int64_t>(offset[i]));
    out.push_back(std::move(a));
  }
  return out;
}

// Checks slot ids and tracks, per tensor slot, the instruction after which the
// value it holds is no longer read.
struct SlotChecker {
  const LoadedProgram& lp;
  uint32_t num_tensors, num_values;
  size_t current = 0;
  std::vector<bool> tensor_defined, value_defined;
  std::vector<int64_t> last_touch;  // instruction that last wrote or read the live value
  std::vector<std::vector<uint32_t>>& release;

  void tensor(uint32_t idx, bool is_output) {
    if (idx >= num_tensors) fail("tensor id " + std::to_string(idx) + " out of range");
    if (is_output) {
      // An instruction overwriting a slot it also reads drops the old value
      // itself; releasing "after" it would drop the new one.
      if (last_touch[idx] == static_cast<int64_t>(current)) last_touch[idx] = -1;
      retire(idx);
      tensor_defined[idx] = true;
    } else if (!tensor_defined[idx]) {
      fail("tensor slot " + std::to_string(idx) + " is read before it is written");
    }
    last_touch[idx] = static_cast<int64_t>(current);
  }
  void value(uint32_t idx, bool is_output) {
    if (idx >= num_values) fail("value id " + std::to_string(idx) + " out of range");
    if (is_output) value_defined[idx] = true;
    else if (!value_defined[idx]) fail("value slot " + std::to_string(idx) + " is read before it is written");
  }
  void retire(uint32_t idx) {
    if (last_touch[idx] >= 0) release[static_cast<size_t>(last_touch[idx])].push_back(idx);
    last_touch[idx] = -1;
  }
};

void check_io(const flatbuffers::Vector<flatbuffers::Offset<mlxd::IOSlot>>* io, const char* what,
              uint32_t nt, uint32_t nv) {
  if (io == nullptr) return;
  for (const auto* s : *io) {
    std::string name = std::string(what) + " '" + payload_name(s->name()) + "'";
    check_dtype(s->dtype(), name);
    if (s->kind() == mlxd::SlotKind::Tensor) {
      if (!s->tid() || s->tid()->idx() >= nt) fail(name + ": tensor id out of range");
    } else if (s->kind() >= mlxd::SlotKind::Int && s->kind() <= mlxd::SlotKind::Bool) {
      if (!s->vid() || s->vid()->idx() >= nv) fail(name + ": value id out of range");
    } else {
      fail(name + ": unknown slot kind");
    }
    if (s->shape() && s->shape()->size() > kMaxRank) fail(name + ": rank too large");
    // Sizes must fit ExecuTorch's int32 SizesType; a dynamic dim needs min <= max.
    constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
    if (s->shape())
      for (const auto* d : *s->shape())
        if (d->size() < 0 || d->size() > kMaxDim ||
            (d->dynamic() && (d->min() < 0 || d->min() > d->max() || d->max() > kMaxDim)))
          fail(name + ": bad dimension bounds");
  }
}

// ---------------------------------------------------------------------------
// Per-node field checks that need no tensor shapes: axes within the largest
// rank, strides/kernels/dilations/groups positive, paddings non-negative. The
// exec functions check what depends on shapes at run time; these catch what
// would otherwise reach MLX as a division by zero or an out-of-bounds view.

void check_axis(int64_t a, const char* field) {
  if (a < -kMaxRank || a >= kMaxRank) fail(std::string(field) + " " + std::to_string(a) + " out of range");
}
void check_axes(const flatbuffers::Vector<int32_t>* v, const char* field) {
  if (v == nullptr) return;
  if (v->size() > kMaxRank) fail(std::string(field) + ": too many entries");
  for (int32_t a : *v) check_axis(a, field);
}
void check_min(int64_t x, int64_t lo, const char* field) {
  if (x < lo) fail(std::string(field) + " " + std::to_string(x) + " must be >= " + std::to_string(lo));
}
// An int list of at most kMaxRank entries, each >= lo.
void check_all(const flatbuffers::Vector<int32_t>* v, int64_t lo, const char* field) {
  if (v == nullptr) return;
  if (v->size() > kMaxRank) fail(std::string(field) + ": too many entries");
  for (int32_t x : *v) check_min(x, lo, field);
}

using NodeCheck = void (*)(const void*);
template <typename T, void (*F)(const T&)>
void typed(const void* n) { F(*static_cast<const T*>(n)); }

void axis_of(const auto& n) { check_axis(n.axis(), "axis"); }
void axes_of(const auto& n) { check_axes(n.axes(), "axes"); }
void slice_fields(const auto& n) { axis_of(n); if (n.step() == 0) fail("step must not be 0"); }
void conv_fields(const mlxd::ConvNode& n) {
  check_all(n.stride(), 1, "stride");
  check_all(n.dilation(), 1, "dilation");
  check_all(n.padding(), 0, "padding");
  check_all(n.output_padding(), 0, "output_padding");
  check_min(n.groups(), 1, "groups");
}
void block_fields(const mlxd::InvertedResidualNode& n) {
  check_all(n.stride(), 1, "stride");
  check_all(n.padding(), 0, "padding");
  check_all(n.padding_hi(), 0, "padding_hi");
}
void pool_fields(const mlxd::PoolNode& n) {
  check_all(n.kernel(), 1, "kernel");
  check_all(n.stride(), 1, "stride");
  check_all(n.dilation(), 1, "dilation");
  check_all(n.padding(), 0, "padding");
  check_min(n.divisor(), 0, "divisor");
}
void transpose_fields(const mlxd::TransposeNode& n) { check_axes(n.perm(), "perm"); }
void tile_fields(const mlxd::TileNode& n) { check_all(n.reps(), 0, "reps"); }
void pixel_shuffle_fields(const mlxd::PixelShuffleNode& n) { check_min(n.factor(), 1, "factor"); }
void group_norm_fields(const mlxd::GroupNormNode& n) { check_min(n.groups(), 1, "groups"); }
void norm_ndim(const auto& n) {
  check_min(n.normalized_ndim(), 0, "normalized_ndim");
  check_axis(n.normalized_ndim() - 1, "normalized_ndim");
}
void sym_size_fields(const mlxd::SymSizeNode& n) { check_axis(n.dim(), "dim"); }
void roll_fields(const mlxd::RollNode& n) {
  check_axes(n.axes(), "axes");
  if (n.shifts() && n.shifts()->size() > kMaxRank) fail("shifts: too many entries");
}

// Indexed by mlxd::Node; node types without static fields to check stay null.
const std::vector<NodeCheck>& node_checks() {
  static const std::vector<NodeCheck> table = [] {
    std::vector<NodeCheck> t(kNumNodeTypes + 1, nullptr);
    auto on = [&](mlxd::Node type, NodeCheck f) { t[static_cast<size_t>(type)] = f; };
    using N = mlxd::Node;
    on(N::ReduceNode, typed<mlxd::ReduceNode, axes_of>);
    on(N::ArgReduceNode, typed<mlxd::ArgReduceNode, axis_of>);
    on(N::SoftmaxNode, typed<mlxd::SoftmaxNode, axis_of>);
    on(N::VarNode, typed<mlxd::VarNode, axes_of>);
    on(N::CumulativeNode, typed<mlxd::CumulativeNode, axis_of>);
    on(N::TransposeNode, typed<mlxd::TransposeNode, transpose_fields>);
    on(N::ExpandDimsNode, typed<mlxd::ExpandDimsNode, axes_of>);
    on(N::SqueezeNode, typed<mlxd::SqueezeNode, axes_of>);
    on(N::SliceNode, typed<mlxd::SliceNode, slice_fields>);
    on(N::SelectNode, typed<mlxd::SelectNode, axis_of>);
    on(N::ConcatNode, typed<mlxd::ConcatNode, axis_of>);
    on(N::StackNode, typed<mlxd::StackNode, axis_of>);
    on(N::SplitNode, typed<mlxd::SplitNode, axis_of>);
    on(N::TakeNode, typed<mlxd::TakeNode, axis_of>);
    on(N::TakeAlongAxisNode, typed<mlxd::TakeAlongAxisNode, axis_of>);
    on(N::LayerNormNode, typed<mlxd::LayerNormNode, norm_ndim>);
    on(N::RmsNormNode, typed<mlxd::RmsNormNode, norm_ndim>);
    on(N::SymSizeNode, typed<mlxd::SymSizeNode, sym_size_fields>);
    on(N::TileNode, typed<mlxd::TileNode, tile_fields>);
    on(N::RollNode, typed<mlxd::RollNode, roll_fields>);
    on(N::FlipNode, typed<mlxd::FlipNode, axes_of>);
    on(N::GatherNode, typed<mlxd::GatherNode, axes_of>);
    on(N::ScatterNode, typed<mlxd::ScatterNode, axes_of>);
    on(N::ScatterAxisNode, typed<mlxd::ScatterAxisNode, axis_of>);
    on(N::SliceUpdateNode, typed<mlxd::SliceUpdateNode, slice_fields>);
    on(N::ConvNode, typed<mlxd::ConvNode, conv_fields>);
    on(N::PoolNode, typed<mlxd::PoolNode, pool_fields>);
    on(N::InvertedResidualNode, typed<mlxd::InvertedResidualNode, block_fields>);
    on(N::PixelShuffleNode, typed<mlxd::PixelShuffleNode, pixel_shuffle_fields>);
    on(N::GroupNormNode, typed<mlxd::GroupNormNode, group_norm_fields>);
    on(N::VectorNormNode, typed<mlxd::VectorNormNode, axes_of>);
    on(N::SortNode, typed<mlxd::SortNode, axis_of>);
    on(N::TopkNode, typed<mlxd::TopkNode, axis_of>);
    on(N::MedianNode, typed<mlxd::MedianNode, axis_of>);
    return t;
  }();
  return table;
}

}  // namespace

void set_huge_page_constants(bool on) { g_huge_pages.store(on, std::memory_order_relaxed); }
bool huge_page_constants() { return g_huge_pages.load(std::memory_order_relaxed); }
void set_constant_arena(bool on) { g_constant_arena.store(on, std::memory_order_relaxed); }
bool constant_arena() { return g_constant_arena.load(std::memory_order_relaxed); }

std::shared_ptr<const LoadedProgram> load_program(const void* data, size_t size,
                                                   const executorch::runtime::NamedDataMap* named_data) {
  auto lp = std::make_shared<LoadedProgram>();
  if (data == nullptr || size < 8) fail("payload too small");
  lp->blob.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + size);
  if (!flatbuffers::BufferHasIdentifier(lp->blob.data(), kFileIdentifier))
    fail("payload is not an mlx_delegate program (bad file identifier)");
  flatbuffers::Verifier::Options opts;
  opts.max_depth = 64;
  opts.max_tables = 1u << 24;
  flatbuffers::Verifier verifier(lp->blob.data(), lp->blob.size(), opts);
  if (!mlxd::VerifyProgramBuffer(verifier)) fail("payload failed FlatBuffers verification (corrupt or truncated)");
  const auto* p = mlxd::GetProgram(lp->blob.data());
  lp->program = p;
  if (p->version() != kSchemaVersion)
    fail("payload schema version " + std::to_string(p->version()) + " is not supported (runtime reads " +
         std::to_string(kSchemaVersion) + ")");
  if (p->min_revision() > kSchemaRevision)
    fail("payload uses schema revision " + std::to_string(p->min_revision()) + " but this runtime reads up to " +
         std::to_string(kSchemaRevision) + ": it was lowered by a newer mlx-delegate; upgrade the runtime");
  const uint32_t nt = p->num_tensors(), nv = p->num_values();
  // Every slot in use is named by at least one 4-byte id in the payload, so
  // counts above the payload size are corrupt (and would cost memory per call).
  const size_t slot_cap = std::min<size_t>(kMaxSlots, std::max<size_t>(size, 64));
  if (nt > slot_cap || nv > slot_cap)
    fail("slot counts (" + std::to_string(nt) + " tensors, " + std::to_string(nv) + " values) exceed what a " +
         std::to_string(size) + "-byte payload can use");
  lp->method = p->method() ? p->method()->str() : "";
  check_io(p->inputs(), "input", nt, nv);
  check_io(p->outputs(), "output", nt, nv);

  size_t n_instr = p->instructions() ? p->instructions()->size() : 0;
  lp->release_after.resize(n_instr + 1);
  SlotChecker checker{*lp, nt, nv, 0, std::vector<bool>(nt), std::vector<bool>(nv),
                      std::vector<int64_t>(nt, -1), lp->release_after};
  // Inputs, constants and buffers are defined before the first instruction;
  // their "last touch" is a virtual instruction -1 (never released early
  // unless read later).
  if (p->inputs())
    for (const auto* s : *p->inputs()) {
      if (s->kind() == mlxd::SlotKind::Tensor) checker.tensor_defined[s->tid()->idx()] = true;
      else checker.value_defined[s->vid()->idx()] = true;
    }
  if (p->constants()) {
    for (const auto* c : *p->constants())
      if (!c->tid() || c->tid()->idx() >= nt)
        fail("constant '" + payload_name(c->name()) + "': tensor id out of range");
    auto arena = load_arena(named_data, *p->constants());
    for (size_t i = 0; i < p->constants()->size(); ++i) {
      const auto* c = p->constants()->Get(i);
      std::string what = "constant '" + payload_name(c->name()) + "'";
      check_dtype(c->dtype(), what);
      lp->constants.push_back({c->tid()->idx(), arena ? (*arena)[i]
                                                      : load_named(named_data, c->key(), c->dtype(), c->shape(), what)});
      checker.tensor_defined[c->tid()->idx()] = true;
    }
  }
  lp->converted = std::make_unique<ConvertedConstants>();
  lp->converted->is_constant.assign(nt, false);
  for (const auto& c : lp->constants) lp->converted->is_constant[c.tid] = true;
  if (p->buffers())
    for (const auto* b : *p->buffers()) {
      std::string what = "mutable buffer '" + payload_name(b->name()) + "'";
      if (!b->tid() || b->tid()->idx() >= nt) fail(what + ": tensor id out of range");
      if (b->update() && b->update()->idx() >= nt) fail(what + ": update id out of range");
      check_dtype(b->dtype(), what);
      lp->buffers.push_back({b->tid()->idx(), b->update() ? int64_t(b->update()->idx()) : -1,
                             load_named(named_data, b->key(), b->dtype(), b->shape(), what),
                             payload_name(b->name())});
      checker.tensor_defined[b->tid()->idx()] = true;
    }

  for (size_t i = 0; i < n_instr; ++i) {
    const auto* ins = p->instructions()->Get(i);
    auto type = ins->node_type();
    if (type == mlxd::Node::NONE || static_cast<int>(type) > kNumNodeTypes || ins->node() == nullptr)
      fail("instruction " + std::to_string(i) + ": unknown node type " + std::to_string(int(type)));
    checker.current = i;
    try {
      // Reads first, then writes, so "x = f(x)" is valid.
      struct Reads {
        SlotChecker& c;
        void tensor(uint32_t idx, bool out) { if (!out) c.tensor(idx, false); }
        void value(uint32_t idx, bool out) { if (!out) c.value(idx, false); }
      } reads{checker};
      struct Writes {
        SlotChecker& c;
        void tensor(uint32_t idx, bool out) { if (out) c.tensor(idx, true); }
        void value(uint32_t idx, bool out) { if (out) c.value(idx, true); }
      } writes{checker};
      visit_slots(type, ins->node(), reads);
      visit_slots(type, ins->node(), writes);
      if (auto check = node_checks()[static_cast<size_t>(type)]) check(ins->node());
    } catch (const LoadError& e) {
      fail("instruction " + std::to_string(i) + " (" + kNodeNames[int(type)] + "): " + e.what());
    }
    lp->types.push_back(type);
    lp->nodes.push_back(ins->node());
  }

  // Values that must survive to the end of the call are never released.
  std::vector<bool> keep(nt);
  if (p->outputs())
    for (const auto* s : *p->outputs()) {
      if (s->kind() == mlxd::SlotKind::Tensor) {
        if (!checker.tensor_defined[s->tid()->idx()]) fail("output tensor slot is never written");
        keep[s->tid()->idx()] = true;
      } else if (!checker.value_defined[s->vid()->idx()]) {
        fail("output value slot is never written");
      }
    }
  for (const auto& b : lp->buffers)
    if (b.update_tid >= 0) {
      if (!checker.tensor_defined[b.update_tid]) fail("mutable buffer '" + b.name + "': update slot never written");
      keep[b.update_tid] = true;
    }
  for (uint32_t t = 0; t < nt; ++t)
    if (!keep[t]) checker.retire(t);
  for (auto& list : lp->release_after)
    std::erase_if(list, [&](uint32_t t) { return keep[t]; });
  return lp;
}

}  // namespace mlxd::rt
