#include "interpreter.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <executorch/runtime/core/exec_aten/util/dim_order_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>

#include "buffer_cache.h"
#include "stream_wait.h"

namespace mlxd::rt {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::EValue;
using executorch::runtime::Span;

std::optional<mlxd::DType> from_et(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return mlxd::DType::f32;
    case ScalarType::Half: return mlxd::DType::f16;
    case ScalarType::BFloat16: return mlxd::DType::bf16;
    case ScalarType::Double: return mlxd::DType::f64;
    case ScalarType::Char: return mlxd::DType::i8;
    case ScalarType::Short: return mlxd::DType::i16;
    case ScalarType::Int: return mlxd::DType::i32;
    case ScalarType::Long: return mlxd::DType::i64;
    case ScalarType::Byte: return mlxd::DType::u8;
    case ScalarType::Bool: return mlxd::DType::bool_;
    default: return std::nullopt;
  }
}

std::string slot_name(const mlxd::IOSlot* s, const char* what, size_t i) {
  return std::string(what) + " " + std::to_string(i) + (s->name() ? " ('" + payload_name(s->name()) + "')" : "");
}

std::string shape_str(const Tensor& t) {
  std::string s = "[";
  for (ssize_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// Checks an input tensor against the exported dtype, rank and bounds.
template <typename Name>
void check_input(const Tensor& t, const mlxd::IOSlot* s, const Name& name) {
  auto dt = from_et(t.scalar_type());
  if (!dt || *dt != s->dtype())
    throw std::invalid_argument(name() + ": expected dtype " + dtype_name(s->dtype()) + ", got ScalarType " +
                                std::to_string(static_cast<int>(t.scalar_type())));
  size_t rank = s->shape() ? s->shape()->size() : 0;
  if (static_cast<size_t>(t.dim()) != rank)
    throw std::invalid_argument(name() + ": expected rank " + std::to_string(rank) + ", got shape " + shape_str(t));
  for (size_t d = 0; d < rank; ++d) {
    const auto* dim = s->shape()->Get(d);
    int64_t n = t.size(d);
    bool ok = dim->dynamic() ? (n >= dim->min() && n <= dim->max()) : n == dim->size();
    if (!ok)
      throw std::invalid_argument(
          name() + ": dimension " + std::to_string(d) + " is " + std::to_string(n) + " in shape " + shape_str(t) +
          (dim->dynamic() ? ", outside its exported range [" + std::to_string(dim->min()) + ", " +
                                std::to_string(dim->max()) + "]"
                          : ", expected " + std::to_string(dim->size())));
  }
}

bool default_dim_order(const Tensor& t) {
  return executorch::runtime::is_contiguous_dim_order(t.dim_order().data(), t.dim());
}

mx::Shape shape_of(const Tensor& t) {
  mx::Shape s;
  for (ssize_t i = 0; i < t.dim(); ++i) s.push_back(static_cast<int>(t.size(i)));
  return s;
}

// Whether MLX's allocator is the CPU one (mlx/backend/no_gpu/allocator.cpp), which keeps a buffer's byte
// size in the size_t just before its data (Buffer::raw_ptr() is ptr() + 1 size_t) and cannot wrap foreign
// memory (make_buffer gives null), so mx::array(void*, ...) copies the caller's tensor on every call: a
// 224 x 224 image, 602 KB, cost ~30 us of a 2.2 ms MobileNetV3 call (2026-11-28). Probed once on a fresh
// buffer; Metal's and CUDA's buffers are objects whose raw_ptr() lies elsewhere.
bool cpu_allocator_size_header() {
  static const bool v = [] {
    mx::allocator::Data d = mx::allocator::malloc(64);
    mx::allocator::Buffer b = d.buffer();
    return b.ptr() != nullptr && b.raw_ptr() == static_cast<size_t*>(b.ptr()) + 1 &&
           *static_cast<const size_t*>(b.ptr()) >= 64;
  }();
  return v;
}

// The caller's memory as an MLX array, without a copy where the allocator allows: MLX's own make_buffer
// (Metal), or on the CPU allocator a buffer whose data starts at `data`. Such a buffer is not owned
// (never donated, never freed by MLX); its size header is the caller's 8 bytes before `data`, which
// MLX reads only to decide whether Contiguous may share a row-contiguous input's buffer (either
// answer is right), so those bytes must lie on `data`'s own page.
mx::array wrap_caller_memory(void* data, mx::Shape shape, mx::Dtype dtype) {
  const auto addr = reinterpret_cast<uintptr_t>(data);
  if (data && cpu_allocator_size_header() && addr % alignof(size_t) == 0 && addr % 4096 >= sizeof(size_t))
    return mx::array(mx::allocator::Data(mx::allocator::Buffer(static_cast<size_t*>(data) - 1),
                                         [](mx::allocator::Buffer) {}),
                     std::move(shape), dtype);
  return mx::array(data, std::move(shape), dtype, [](void*) {});
}

// A caller tensor in another dim order (channels-last, say) is read in place: the
// memory holds the axes in dim-order sequence, and a transpose restores torch's
// logical order.
mx::array bind_tensor(const Tensor& t, mx::Dtype dtype) {
  void* data = const_cast<void*>(t.const_data_ptr());
  if (default_dim_order(t)) return wrap_caller_memory(data, shape_of(t), dtype);
  mx::Shape physical;
  std::vector<int> logical(t.dim());
  for (ssize_t k = 0; k < t.dim(); ++k) {
    int d = static_cast<int>(t.dim_order()[k]);
    physical.push_back(static_cast<int>(t.size(d)));
    logical[d] = static_cast<int>(k);
  }
  return mx::transpose(wrap_caller_memory(data, physical, dtype), logical);
}

// Writes an evaluated result into `dst` in row-major order. Results stay
// views (no Contiguous node in the graph: one primitive fewer per call); only
// a strided or broadcast one is made contiguous here, in a second evaluation.
void copy_result(const mx::array& a, void* dst) {
  if (a.nbytes() == 0) return;
  if (a.flags().row_contiguous) {
    std::memcpy(dst, a.data<uint8_t>(), a.nbytes());
    return;
  }
  mx::array c = mx::contiguous(a);
  eval_follow_up({c});
  std::memcpy(dst, c.data<uint8_t>(), c.nbytes());
}

// Programs up to this many nodes enqueue their graph in microseconds: a
// lingering stream thread is kept awake through it (stream_wait.h).
constexpr size_t kSmallGraphNodes = 32;

}  // namespace

mx::array owned_copy(const mx::array& a) {
  mx::array c = mx::contiguous(a);
  eval_follow_up({c});
  mx::array out(mx::allocator::malloc(c.nbytes()), c.shape(), c.dtype());
  std::memcpy(out.data<uint8_t>(), c.data<uint8_t>(), c.nbytes());
  return out;
}

Handle::Handle(std::shared_ptr<const LoadedProgram> program) : program_(std::move(program)) {
  ctx_.converted = program_->converted.get();
  reset_buffers();
  plan_compile();
}

void Handle::reset_buffers() {
  std::lock_guard<std::mutex> lock(mutex_);
  reset_buffers_unlocked();
}

void Handle::reset_buffers_unlocked() {
  buffers_.clear();
  for (const auto& b : program_->buffers) buffers_.push_back(b.initial);
}

void Handle::bind_inputs(Span<EValue*> args) {
  const auto* p = program_->program;
  size_t n_in = p->inputs() ? p->inputs()->size() : 0;
  size_t n_out = p->outputs() ? p->outputs()->size() : 0;
  if (args.size() != n_in + n_out)
    throw std::invalid_argument("expected " + std::to_string(n_in) + " inputs and " + std::to_string(n_out) +
                                " outputs, got " + std::to_string(args.size()) + " arguments");
  ctx_.tensors.assign(p->num_tensors(), std::nullopt);
  ctx_.values.assign(p->num_values(), Value{});
  pinned_.clear();
  for (size_t i = 0; i < n_in; ++i) {
    const auto* s = p->inputs()->Get(i);
    const EValue* ev = args[i];
    auto name = [&] { return slot_name(s, "input", i); };  // built only for errors
    switch (s->kind()) {
      case mlxd::SlotKind::Tensor: {
        if (ev == nullptr || !ev->isTensor()) throw std::invalid_argument(name() + ": expected a tensor");
        const Tensor& t = ev->toTensor();
        check_input(t, s, name);
        mx::array a = bind_tensor(t, to_mlx(s->dtype()));
        pinned_.push_back(a);
        ctx_.tensors[s->tid()->idx()] = std::move(a);
        break;
      }
      case mlxd::SlotKind::Int:
      case mlxd::SlotKind::Bool:
        if (ev && ev->isInt()) ctx_.values[s->vid()->idx()] = ev->toInt();
        else if (ev && ev->isBool()) ctx_.values[s->vid()->idx()] = int64_t(ev->toBool());
        else throw std::invalid_argument(name() + ": expected an int");
        break;
      case mlxd::SlotKind::Float:
        if (ev && ev->isDouble()) ctx_.values[s->vid()->idx()] = ev->toDouble();
        else if (ev && ev->isInt()) ctx_.values[s->vid()->idx()] = double(ev->toInt());
        else throw std::invalid_argument(name() + ": expected a float");
        break;
    }
  }
  for (const auto& c : program_->constants) ctx_.tensors[c.tid] = c.value;
  for (size_t i = 0; i < buffers_.size(); ++i) ctx_.tensors[program_->buffers[i].tid] = buffers_[i];
}

void Handle::exec_node(size_t i, ExecContext& ctx) const {
  auto type = program_->types[i];
  try {
    kExecTable[static_cast<int>(type)](program_->nodes[i], ctx);
  } catch (const std::exception& e) {
    throw std::runtime_error("node " + std::to_string(i) + " (" + kNodeNames[static_cast<int>(type)] +
                             "): " + e.what());
  }
}

void Handle::run_nodes() {
  const auto& lp = *program_;
  for (size_t i = 0; i < lp.nodes.size(); ++i) {
    exec_node(i, ctx_);
    if (!lp.program->keep_intermediates())
      for (uint32_t t : lp.release_after[i]) ctx_.tensors[t].reset();
  }
}

void Handle::write_outputs(Span<EValue*> args) {
  const auto* p = program_->program;
  size_t n_out = p->outputs() ? p->outputs()->size() : 0;
  std::vector<mx::array> results;
  std::vector<int64_t> value_outputs;
  for (size_t i = 0; i < n_out; ++i) {
    const auto* s = p->outputs()->Get(i);
    if (s->kind() != mlxd::SlotKind::Tensor) {
      value_outputs.push_back(ctx_.int_value(s->vid()->idx()));
      continue;
    }
    mx::array a = *ctx_.tensors[s->tid()->idx()];
    if (a.dtype() != to_mlx(s->dtype())) a = mx::astype(a, to_mlx(s->dtype()));
    results.push_back(std::move(a));
  }
  std::vector<mx::array> updates;
  for (const auto& b : program_->buffers)
    if (b.update_tid >= 0) updates.push_back(*ctx_.tensors[b.update_tid]);
  // Drop graph references so MLX frees (or reuses in place) each intermediate
  // right after its last use during evaluation.
  std::vector<std::optional<mx::array>> kept;
  if (program_->program->keep_intermediates()) kept = std::move(ctx_.tensors);
  ctx_.tensors.clear();
  finish(args, std::move(results), std::move(updates), value_outputs, pace_);
}

// Evaluates the results and buffer updates, keeps the new buffer states and
// copies the results into the output tensors.
void Handle::finish(Span<EValue*> args, std::vector<mx::array> results, std::vector<mx::array> updates,
                    const std::vector<int64_t>& value_outputs, EvalPace& pace) {
  const auto* p = program_->program;
  size_t n_in = p->inputs() ? p->inputs()->size() : 0;
  size_t n_out = p->outputs() ? p->outputs()->size() : 0;
  std::vector<mx::array> all = results;
  all.insert(all.end(), updates.begin(), updates.end());
  // Drop our references to buffers being replaced so MLX can update them in
  // place (a KV cache write then costs the update, not a copy of the cache).
  for (const auto& b : program_->buffers)
    if (b.update_tid >= 0) buffers_[&b - program_->buffers.data()] = b.initial;
  try {
    // Spins across the hand-offs to MLX's stream thread only while calls come back to back
    // (stream_wait.h): an unconditional spin cost 2-4 ms per call after idle gaps of a few ms.
    const size_t mark = buffer_cache_mark();
    eval_adaptive(all, pace, program_->nodes.size() <= kSmallGraphNodes);
    fit_buffer_cache(mark);
  } catch (...) {
    // The old contents may have been consumed in place: start over from the
    // initial values rather than keep half-written state.
    reset_buffers_unlocked();
    throw;
  }
  all.clear();

  // A buffer value that still points into caller memory is copied first.
  size_t u = 0;
  for (size_t i = 0; i < program_->buffers.size(); ++i) {
    if (program_->buffers[i].update_tid < 0) continue;
    mx::array& v = updates[u++];
    bool aliases_input = false;
    for (const auto& in : pinned_)
      aliases_input |= in.buffer().ptr() != nullptr && v.buffer().ptr() == in.buffer().ptr();
    buffers_[i] = aliases_input ? owned_copy(v) : v;
  }

  size_t r = 0, scalar = 0;
  for (size_t i = 0; i < n_out; ++i) {
    const auto* s = p->outputs()->Get(i);
    EValue* ev = args[n_in + i];
    auto name = [&] { return slot_name(s, "output", i); };
    if (ev == nullptr) throw std::invalid_argument(name() + ": missing output argument");
    if (s->kind() != mlxd::SlotKind::Tensor) {
      *ev = EValue(value_outputs[scalar++]);
      continue;
    }
    if (!ev->isTensor()) throw std::invalid_argument(name() + ": expected an output tensor");
    const mx::array& a = results[r++];
    Tensor out = ev->toTensor();
    std::vector<executorch::aten::SizesType> sizes(a.shape().begin(), a.shape().end());
    auto err = executorch::runtime::resize_tensor(out, {sizes.data(), sizes.size()});
    if (err != executorch::runtime::Error::Ok)
      throw std::runtime_error(name() + ": cannot resize output to the computed shape");
    if (out.nbytes() != a.nbytes())
      throw std::runtime_error(name() + ": output holds " + std::to_string(out.nbytes()) + " bytes, result has " +
                               std::to_string(a.nbytes()));
    if (default_dim_order(out)) {
      copy_result(a, out.mutable_data_ptr());
      continue;
    }
    // The output's memory holds its axes in dim-order sequence.
    std::vector<int> order(out.dim_order().begin(), out.dim_order().end());
    mx::array physical = mx::transpose(a, order);
    eval_follow_up({physical});  // a view of the evaluated result: copy_result reads its strides
    copy_result(physical, out.mutable_data_ptr());
  }
}

void Handle::execute(Span<EValue*> args) {
  std::lock_guard<std::mutex> lock(mutex_);
  DelegateStreamScope stream;  // the graph runs on this thread's delegate stream (the stream park, stream_wait.h)
  try {
    bind_inputs(args);
    bool profiling = profile_enabled();
    bool compiled = !profiling && compile_enabled() && not_compilable_.empty() && run_compiled(args);
    if (!compiled) {
      if (profiling)
        run_nodes_profiled();
      else
        run_nodes();
      write_outputs(args);
      note_interpreted_call();
    }
  } catch (...) {
    ctx_.tensors.clear();
    pinned_.clear();
    trace_error_.clear();
    throw;
  }
  ctx_.values.clear();
  pinned_.clear();
  trace_error_.clear();
}

}  // namespace mlxd::rt
