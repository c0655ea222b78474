#include "interpreter.h"

#include <cstring>

#include <executorch/runtime/core/exec_aten/util/dim_order_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>

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
  return std::string(what) + " " + std::to_string(i) + (s->name() ? " ('" + s->name()->str() + "')" : "");
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
  if (!executorch::runtime::is_contiguous_dim_order(t.dim_order().data(), t.dim()))
    throw std::invalid_argument(name() + ": only contiguous (default dim order) tensors are supported");
}

mx::Shape shape_of(const Tensor& t) {
  mx::Shape s;
  for (ssize_t i = 0; i < t.dim(); ++i) s.push_back(static_cast<int>(t.size(i)));
  return s;
}

// A copy of `a` in memory MLX owns (used when a value would otherwise keep
// pointing at caller memory after the call).
mx::array owned_copy(const mx::array& a) {
  mx::array c = mx::contiguous(a);
  mx::eval(c);
  mx::array out(mx::allocator::malloc(c.nbytes()), c.shape(), c.dtype());
  std::memcpy(out.data<uint8_t>(), c.data<uint8_t>(), c.nbytes());
  return out;
}

}  // namespace

Handle::Handle(std::shared_ptr<const LoadedProgram> program) : program_(std::move(program)) {
  reset_buffers();
}

void Handle::reset_buffers() {
  std::lock_guard<std::mutex> lock(mutex_);
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
        mx::array a(const_cast<void*>(t.const_data_ptr()), shape_of(t), to_mlx(s->dtype()), [](void*) {});
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

void Handle::run_nodes() {
  const auto& lp = *program_;
  for (size_t i = 0; i < lp.nodes.size(); ++i) {
    auto type = lp.types[i];
    try {
      kExecTable[static_cast<int>(type)](lp.nodes[i], ctx_);
    } catch (const std::exception& e) {
      throw std::runtime_error("node " + std::to_string(i) + " (" + kNodeNames[static_cast<int>(type)] +
                               "): " + e.what());
    }
    if (!lp.program->keep_intermediates())
      for (uint32_t t : lp.release_after[i]) ctx_.tensors[t].reset();
  }
}

void Handle::write_outputs(Span<EValue*> args) {
  const auto* p = program_->program;
  size_t n_in = p->inputs() ? p->inputs()->size() : 0;
  size_t n_out = p->outputs() ? p->outputs()->size() : 0;
  std::vector<mx::array> results;
  for (size_t i = 0; i < n_out; ++i) {
    const auto* s = p->outputs()->Get(i);
    if (s->kind() != mlxd::SlotKind::Tensor) continue;
    mx::array a = *ctx_.tensors[s->tid()->idx()];
    if (a.dtype() != to_mlx(s->dtype())) a = mx::astype(a, to_mlx(s->dtype()));
    results.push_back(mx::contiguous(a));
  }
  std::vector<mx::array> updates;
  for (const auto& b : program_->buffers)
    if (b.update_tid >= 0) updates.push_back(*ctx_.tensors[b.update_tid]);
  std::vector<mx::array> all = results;
  all.insert(all.end(), updates.begin(), updates.end());
  // Drop graph references so MLX frees (or reuses in place) each intermediate
  // right after its last use during evaluation.
  std::vector<std::optional<mx::array>> kept;
  if (program_->program->keep_intermediates()) kept = std::move(ctx_.tensors);
  ctx_.tensors.clear();
  // Drop our references to buffers being replaced so MLX can update them in
  // place (a KV cache write then costs the update, not a copy of the cache).
  for (const auto& b : program_->buffers)
    if (b.update_tid >= 0) buffers_[&b - program_->buffers.data()] = b.initial;
  try {
    mx::eval(all);
  } catch (...) {
    // The old contents may have been consumed in place: start over from the
    // initial values rather than keep half-written state.
    buffers_.clear();
    for (const auto& b : program_->buffers) buffers_.push_back(b.initial);
    throw;
  }

  // A buffer value that still points into caller memory is copied first.
  size_t u = 0;
  for (size_t i = 0; i < program_->buffers.size(); ++i) {
    if (program_->buffers[i].update_tid < 0) continue;
    mx::array& v = updates[u++];
    bool aliases_input = false;
    for (const auto& in : pinned_)
      aliases_input |= v.buffer_size() && in.buffer_size() && v.buffer().ptr() == in.buffer().ptr();
    buffers_[i] = aliases_input ? owned_copy(v) : v;
  }

  size_t r = 0;
  for (size_t i = 0; i < n_out; ++i) {
    const auto* s = p->outputs()->Get(i);
    EValue* ev = args[n_in + i];
    auto name = [&] { return slot_name(s, "output", i); };
    if (ev == nullptr) throw std::invalid_argument(name() + ": missing output argument");
    if (s->kind() != mlxd::SlotKind::Tensor) {
      int64_t v = ctx_.int_value(s->vid()->idx());
      *ev = EValue(v);
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
    if (a.nbytes()) std::memcpy(out.mutable_data_ptr(), a.data<uint8_t>(), a.nbytes());
  }
}

void Handle::execute(Span<EValue*> args) {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    bind_inputs(args);
    run_nodes();
    write_outputs(args);
  } catch (...) {
    ctx_.tensors.clear();
    pinned_.clear();
    throw;
  }
  ctx_.values.clear();
  pinned_.clear();
}

}  // namespace mlxd::rt
