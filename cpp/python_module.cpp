// Python entry point: `mlx_delegate._runtime`. Importing it registers the
// backend with the executorch wheel's runtime.
#include <map>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <executorch/runtime/core/named_data_map.h>

#include <mlx/memory.h>

#include "backend.h"
#include "interpreter.h"
#include "loader.h"

namespace nb = nanobind;
using namespace mlxd::rt;

namespace {

// A NamedDataMap over Python-owned bytes, for checking payloads without a .pte.
class DictDataMap final : public executorch::runtime::NamedDataMap {
 public:
  explicit DictDataMap(std::map<std::string, std::string> data) : data_(std::move(data)) {}
  executorch::runtime::Result<const executorch::runtime::TensorLayout> get_tensor_layout(
      std::string_view) const override {
    return executorch::runtime::Error::NotImplemented;
  }
  executorch::runtime::Result<executorch::runtime::FreeableBuffer> get_data(std::string_view key) const override {
    auto it = data_.find(std::string(key));
    if (it == data_.end()) return executorch::runtime::Error::NotFound;
    return executorch::runtime::FreeableBuffer(it->second.data(), it->second.size(), nullptr);
  }
  executorch::runtime::Error load_data_into(std::string_view, void*, size_t) const override {
    return executorch::runtime::Error::NotImplemented;
  }
  executorch::runtime::Result<uint32_t> get_num_keys() const override { return uint32_t(data_.size()); }
  executorch::runtime::Result<const char*> get_key(uint32_t i) const override {
    if (i >= data_.size()) return executorch::runtime::Error::InvalidArgument;
    return std::next(data_.begin(), i)->first.c_str();
  }

 private:
  std::map<std::string, std::string> data_;
};

// Loads (verifies) a payload; raises ValueError naming the problem.
void check_payload(nb::bytes payload, std::map<std::string, std::string> named_data) {
  DictDataMap map(std::move(named_data));
  try {
    auto lp = load_program(payload.c_str(), payload.size(), &map);
    (void)lp;
  } catch (const std::exception& e) {
    throw nb::value_error(e.what());
  }
}

}  // namespace

NB_MODULE(_runtime, m) {
  m.doc() = "mlx_delegate C++ runtime";
  m.def("register_backend", &register_backend, "Register the backend with ExecuTorch (idempotent).");
  m.def("backend_id", [] { return std::string(kBackendId); });
  m.def("schema_version", [] { return kSchemaVersion; });
  m.def("last_error", [] { return last_error(); }, "Message of this thread's last delegate error.");
  m.def("check_payload", &check_payload, nb::arg("payload"), nb::arg("named_data") = std::map<std::string, std::string>{},
        "Verify and load a delegate payload; raises ValueError naming the problem.");
  m.def("peak_memory", [] { return mlx::core::get_peak_memory(); }, "MLX peak memory (bytes) since the last reset.");
  m.def("reset_peak_memory", [] { mlx::core::reset_peak_memory(); });
  m.def("active_memory", [] { return mlx::core::get_active_memory(); });
  m.def("set_compile", &set_compile_enabled, nb::arg("on"),
        "Turn compiled graphs on or off process-wide (MLX_DELEGATE_COMPILE=0 starts with them off).");
  m.def("compile_enabled", &compile_enabled);
  m.def("compile_stats", [] {
    auto s = compile_stats();
    return std::map<std::string, uint64_t>{{"compiled_calls", s.compiled_calls},
                                           {"interpreted_calls", s.interpreted_calls},
                                           {"traces", s.traces}, {"rejected", s.rejected}};
  }, "Process-wide counters: calls served by compiled graphs or node by node, graphs traced, methods rejected.");
  m.def("reset_compile_stats", &reset_compile_stats);
  if (!register_backend()) throw std::runtime_error("mlx_delegate: could not register the backend with ExecuTorch");
}
