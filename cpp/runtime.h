// Shared runtime types: the per-call execution context handed to every
// exec_<Node> function, and small helpers to read schema fields.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <mlx/mlx.h>

#include "mlx_delegate_generated.h"

namespace mlxd::rt {

namespace mx = mlx::core;

// A scalar value slot: symbolic sizes and sym-int arithmetic are int64,
// float scalars are double.
using Value = std::variant<std::monostate, int64_t, double>;

// Thrown by exec functions for bad node contents; the interpreter turns it
// (and any other std::exception) into an ExecuTorch error naming the node.
struct NodeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Text that may hold payload bytes (names, node kinds, error messages), made
// safe to log or hand to Python: the ExecuTorch Python binding decodes log
// lines as UTF-8 and aborts the process on a bad byte. Printable ASCII is kept
// (so the output maps to itself), every other byte becomes \xNN, and text over
// `cap` characters is cut and ends in "...".
constexpr size_t kMaxMessageChars = 1024;  // a whole log line or error message
constexpr size_t kMaxNameChars = 64;       // one payload name inside a message
std::string printable(std::string_view text, size_t cap = kMaxMessageChars);
// A payload string field as it appears in messages: printable() and capped, "?" when absent.
std::string payload_name(const flatbuffers::String* name);

mx::Dtype to_mlx(mlxd::DType dtype);
const char* dtype_name(mlxd::DType dtype);

// Largest tensor (bytes) a node may produce. MLX does not survive a failed
// allocation (it dereferences the null buffer), so a payload whose shapes ask
// for more than the machine has must fail here, before evaluation. Defaults to
// the physical memory size; process-wide.
size_t max_tensor_bytes();
void set_max_tensor_bytes(size_t bytes);
void check_tensor_size(const mx::array& a);

// Indices a node reads from an integer tensor (a KV-cache write position, an
// embedding's token ids) that must lie in [lo, hi]. MLX clamps array indices
// without a word, so the runtime checks them on the host: at once when the
// tensor is a bound input, and on every replay of a compiled graph (recorded
// while tracing).
struct IndexGuard {
  uint32_t tid;
  int64_t lo, hi;
  std::string what;
};
// Throws NodeError when one of `index`'s values (host memory) is outside [lo, hi].
void check_index_guard(const mx::array& index, const IndexGuard& guard);

// Constants converted to another dtype, once per loaded program and kept (ExecContext::in_as).
struct ConvertedConstants {
  std::vector<bool> is_constant;  // by tensor slot
  std::mutex mutex;
  struct Entry {
    mx::array source;  // the constant converted (held, so its id() stays its own): a slot may be recycled
    mx::array value;
  };
  std::map<std::pair<uint32_t, int>, Entry> arrays;  // (slot, dtype) -> converted copy
  std::map<std::pair<uint32_t, int>, Entry> derived;  // (slot, key) -> ExecContext::derived_constant's value
};

// Constants converted by ExecContext::in_as so far, process-wide (tests prove it happens once per program).
uint64_t constant_conversions();

struct ExecContext {
  std::vector<std::optional<mx::array>> tensors;
  std::vector<Value> values;
  mx::StreamOrDevice stream = {};
  std::vector<IndexGuard>* guards = nullptr;  // set while tracing: guards to check on each replay
  std::vector<mx::array>* produced = nullptr;  // set while profiling: the arrays this node wrote

  // See IndexGuard: checks now when the tensor's value is on the host, records the guard while tracing.
  void guard_index(const mlxd::Tid* tid, int64_t lo, int64_t hi, std::string what);

  const mx::array& in(const mlxd::Tid* tid) const {
    if (tid == nullptr) throw NodeError("missing required tensor field");
    const auto& slot = tensors[tid->idx()];  // ids were bounds-checked at load
    if (!slot) throw NodeError("tensor slot " + std::to_string(tid->idx()) + " read before it was written");
    return *slot;
  }
  // A tensor in `dtype`. A constant is converted once per loaded program, evaluated and kept
  // (e.g. fp16 quantization scales for MLX's quantized kernels, which want the activations'
  // dtype): no conversion node per call, in compiled graphs either. Anything else: mx::astype.
  mx::array in_as(const mlxd::Tid* tid, mx::Dtype dtype);
  ConvertedConstants* converted = nullptr;
  // A value computed from a constant by `make` (e.g. a convolution's weights in the Winograd domain), once per
  // loaded program under (slot, key) and kept, like in_as; std::nullopt when the slot holds no constant.
  std::optional<mx::array> derived_constant(const mlxd::Tid* tid, int key,
                                            const std::function<mx::array(const mx::array&)>& make);

  // Optional tensor field (e.g. bias): nullptr when absent.
  const mx::array* maybe_in(const mlxd::Tid* tid) const { return tid ? &in(tid) : nullptr; }

  void set(const mlxd::Tid* tid, mx::array value) {
    if (tid == nullptr) throw NodeError("missing output tensor field");
    check_tensor_size(value);
    if (produced) produced->push_back(value);
    tensors[tid->idx()] = std::move(value);
  }

  int64_t int_value(uint32_t vid) const;
  double float_value(uint32_t vid) const;
  void set_value(const mlxd::Vid* vid, Value v) {
    if (vid == nullptr) throw NodeError("missing output value field");
    values[vid->idx()] = v;
  }

  int64_t resolve(const mlxd::IntOrVid* v) const {
    if (v == nullptr) throw NodeError("missing int field");
    return v->vid() < 0 ? v->literal() : int_value(static_cast<uint32_t>(v->vid()));
  }
  double resolve(const mlxd::FloatOrVid* v) const {
    if (v == nullptr) throw NodeError("missing float field");
    return v->vid() < 0 ? v->literal() : float_value(static_cast<uint32_t>(v->vid()));
  }
  mx::Shape resolve_shape(const flatbuffers::Vector<const mlxd::IntOrVid*>* dims) const;
};

// Normalises a possibly negative axis against `ndim`, throwing when out of range.
int normalize_axis(int axis, int ndim);
std::vector<int> int_vector(const flatbuffers::Vector<int32_t>* v);

}  // namespace mlxd::rt
