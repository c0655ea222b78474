#include "runtime.h"

#include "stream_wait.h"

#include <atomic>

#include <unistd.h>

namespace mlxd::rt {
namespace {

size_t physical_memory() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : size_t(1) << 40;
}

std::atomic<size_t> g_max_tensor_bytes{physical_memory()};

}  // namespace

std::string printable(std::string_view text, size_t cap) {
  static constexpr char kHex[] = "0123456789abcdef";
  auto width = [](unsigned char c) -> size_t { return c >= 0x20 && c < 0x7f ? 1 : 4; };
  size_t full = 0;
  for (unsigned char c : text)
    if ((full += width(c)) > cap) break;
  // Cut at a whole character or escape, leaving room for the "..." marker.
  const bool cut = full > cap;
  const size_t limit = cut ? (cap >= 3 ? cap - 3 : 0) : cap;
  std::string out;
  out.reserve(limit + 3);
  for (unsigned char c : text) {
    if (out.size() + width(c) > limit) break;
    if (width(c) == 1) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (cut && cap >= 3) out += "...";
  return out;
}

std::string payload_name(const flatbuffers::String* name) {
  return name ? printable(std::string_view(name->c_str(), name->size()), kMaxNameChars) : "?";
}

size_t max_tensor_bytes() { return g_max_tensor_bytes.load(std::memory_order_relaxed); }
void set_max_tensor_bytes(size_t bytes) { g_max_tensor_bytes.store(bytes ? bytes : physical_memory()); }

void check_tensor_size(const mx::array& a) {
  // size() is the product of int32 dims: compare in elements to avoid overflow.
  size_t limit = max_tensor_bytes() / a.itemsize();
  if (a.size() > limit)
    throw NodeError("result of " + std::to_string(a.size()) + " elements exceeds the " +
                    std::to_string(max_tensor_bytes()) + "-byte tensor limit");
}

mx::Dtype to_mlx(mlxd::DType dtype) {
  switch (dtype) {
    case mlxd::DType::f32: return mx::float32;
    case mlxd::DType::f16: return mx::float16;
    case mlxd::DType::bf16: return mx::bfloat16;
    case mlxd::DType::f64: return mx::float64;
    case mlxd::DType::i8: return mx::int8;
    case mlxd::DType::i16: return mx::int16;
    case mlxd::DType::i32: return mx::int32;
    case mlxd::DType::i64: return mx::int64;
    case mlxd::DType::u8: return mx::uint8;
    case mlxd::DType::u16: return mx::uint16;
    case mlxd::DType::u32: return mx::uint32;
    case mlxd::DType::u64: return mx::uint64;
    case mlxd::DType::bool_: return mx::bool_;
  }
  throw NodeError("unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(mlxd::DType dtype) {
  auto v = static_cast<int>(dtype);
  return v >= 0 && v <= static_cast<int>(mlxd::DType::MAX) ? mlxd::EnumNameDType(dtype) : "?";
}

void check_index_guard(const mx::array& index, const IndexGuard& guard) {
  if (index.status() != mx::array::Status::available || !index.flags().row_contiguous) return;
  auto check = [&](auto* values) {
    for (size_t i = 0; i < index.size(); ++i) {
      const int64_t v = values[i];
      if (v < guard.lo || v > guard.hi)
        throw NodeError(guard.what + " " + std::to_string(v) + " is outside [" + std::to_string(guard.lo) + ", " +
                        std::to_string(guard.hi) + "]");
    }
  };
  if (index.dtype() == mx::int64) check(index.data<int64_t>());
  else if (index.dtype() == mx::int32) check(index.data<int32_t>());
  // other dtypes are not produced by the exporters we know; MLX clamps them
}

namespace {
std::atomic<uint64_t> g_constant_conversions{0};
}  // namespace

uint64_t constant_conversions() { return g_constant_conversions.load(std::memory_order_relaxed); }

mx::array ExecContext::in_as(const mlxd::Tid* tid, mx::Dtype dtype) {
  const mx::array& a = in(tid);
  if (a.dtype() == dtype) return a;
  if (converted == nullptr || !converted->is_constant[tid->idx()]) return mx::astype(a, dtype);
  std::lock_guard<std::mutex> lock(converted->mutex);
  auto key = std::make_pair(tid->idx(), static_cast<int>(dtype.val()));
  auto it = converted->arrays.find(key);
  if (it != converted->arrays.end() && it->second.source.id() == a.id()) return it->second.value;
  if (it != converted->arrays.end()) return mx::astype(a, dtype);  // the slot holds something else now
  mx::array c = mx::astype(a, dtype);
  eval_follow_up({c});  // a constant, not a traced value: allowed while a graph is being compiled
  converted->arrays.emplace(key, ConvertedConstants::Entry{a, c});
  g_constant_conversions.fetch_add(1, std::memory_order_relaxed);
  return c;
}

std::optional<mx::array> ExecContext::derived_constant(const mlxd::Tid* tid, int key,
                                                      const std::function<mx::array(const mx::array&)>& make) {
  const mx::array& a = in(tid);
  if (converted == nullptr || !converted->is_constant[tid->idx()]) return std::nullopt;
  std::lock_guard<std::mutex> lock(converted->mutex);
  auto it = converted->derived.find({tid->idx(), key});
  if (it != converted->derived.end()) {
    if (it->second.source.id() == a.id()) return it->second.value;
    return std::nullopt;  // the slot holds something else now
  }
  if (a.status() != mx::array::Status::available) eval_follow_up({a});
  mx::array c = make(a);
  eval_follow_up({c});
  converted->derived.emplace(std::make_pair(tid->idx(), key), ConvertedConstants::Entry{a, c});
  return c;
}

void ExecContext::guard_index(const mlxd::Tid* tid, int64_t lo, int64_t hi, std::string what) {
  IndexGuard guard{tid->idx(), lo, hi, std::move(what)};
  check_index_guard(in(tid), guard);
  if (guards) guards->push_back(std::move(guard));
}

int64_t ExecContext::int_value(uint32_t vid) const {
  const Value& v = values[vid];
  if (auto* i = std::get_if<int64_t>(&v)) return *i;
  if (auto* f = std::get_if<double>(&v)) return static_cast<int64_t>(*f);
  throw NodeError("value slot " + std::to_string(vid) + " read before it was written");
}

double ExecContext::float_value(uint32_t vid) const {
  const Value& v = values[vid];
  if (auto* f = std::get_if<double>(&v)) return *f;
  if (auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  throw NodeError("value slot " + std::to_string(vid) + " read before it was written");
}

mx::Shape ExecContext::resolve_shape(const flatbuffers::Vector<const mlxd::IntOrVid*>* dims) const {
  mx::Shape shape;
  if (dims == nullptr) return shape;
  for (const auto* d : *dims) {
    int64_t v = resolve(d);
    if (v < -1 || v > std::numeric_limits<int32_t>::max()) throw NodeError("bad dimension " + std::to_string(v));
    shape.push_back(static_cast<int>(v));
  }
  return shape;
}

int normalize_axis(int axis, int ndim) {
  int a = axis < 0 ? axis + ndim : axis;
  if (a < 0 || a >= std::max(ndim, 1))
    throw NodeError("axis " + std::to_string(axis) + " out of range for rank " + std::to_string(ndim));
  return a;
}

std::vector<int> int_vector(const flatbuffers::Vector<int32_t>* v) {
  return v ? std::vector<int>(v->begin(), v->end()) : std::vector<int>{};
}

}  // namespace mlxd::rt
