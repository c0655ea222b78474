// Registers the delegate with the stock ExecuTorch runtime (libexecutorch.so
// from the executorch wheel) under the id the AOT side writes into .pte files.
#include "backend.h"

#include <cstdlib>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/log.h>
#include <executorch/runtime/platform/platform.h>

#include "interpreter.h"

namespace mlxd::rt {
namespace {

using executorch::runtime::ArrayRef;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::CompileSpec;
using executorch::runtime::DelegateHandle;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::Result;
using executorch::runtime::Span;

thread_local std::string t_last_error;

void report(const char* phase, const std::exception& e) {
  t_last_error = printable(std::string(phase) + ": " + e.what());
  ET_LOG(Error, "%s: %s", kBackendId, t_last_error.c_str());
}

class MLXDelegateBackend final : public executorch::runtime::BackendInterface {
 public:
  bool is_available() const override { return true; }

  Result<DelegateHandle*> init(BackendInitContext& context, FreeableBuffer* processed,
                               ArrayRef<CompileSpec>) const override {
    try {
      auto program = load_program(processed->data(), processed->size(), context.get_named_data_map());
      processed->Free();  // the loader keeps its own copy
      return new Handle(std::move(program));
    } catch (const LoadError& e) {
      report("init", e);
      return Error::InvalidProgram;
    } catch (const std::exception& e) {
      report("init", e);
      return Error::Internal;
    }
  }

  Error execute(BackendExecutionContext&, DelegateHandle* handle, Span<EValue*> args) const override {
    try {
      static_cast<Handle*>(handle)->execute(args);
      return Error::Ok;
    } catch (const std::invalid_argument& e) {
      report("execute", e);
      return Error::InvalidArgument;
    } catch (const std::exception& e) {
      report("execute", e);
      return Error::Internal;
    }
  }

  void destroy(DelegateHandle* handle) const override { delete static_cast<Handle*>(handle); }
};

// ExecuTorch's own messages quote .pte contents too (an unregistered backend
// id, a missing method name), and the Python binding's log sink (std::cerr
// redirected to sys.stderr) aborts the process on a line that is not UTF-8.
// Every log line therefore passes through printable() on its way to the sink
// that was in place before ours.
decltype(executorch::runtime::PalImpl::emit_log_message) g_next_log_sink = nullptr;

void printable_log_sink(et_timestamp_t timestamp, et_pal_log_level_t level, const char* filename,
                        const char* function, size_t line, const char* message, size_t length) {
  std::string safe = printable(std::string_view(message ? message : "", message ? length : 0));
  g_next_log_sink(timestamp, level, filename, function, line, safe.c_str(), safe.size());
}

}  // namespace

bool install_printable_log_sink() {
  // The PAL table is a mutable global of libexecutorch; its entry is swapped in
  // place because register_pal() logs an error line whenever a PAL was
  // registered before (the Python binding always registers one).
  auto* pal = const_cast<executorch::runtime::PalImpl*>(executorch::runtime::get_pal_impl());
  if (pal == nullptr || pal->emit_log_message == nullptr) return false;
  if (pal->emit_log_message != printable_log_sink) {
    g_next_log_sink = pal->emit_log_message;
    pal->emit_log_message = printable_log_sink;
  }
  return true;
}

bool register_backend() {
  install_printable_log_sink();
  // float32 products stay float32 on CUDA, as in eager PyTorch (whose matmuls do not use TF32 by
  // default): MLX's CUDA backend otherwise runs them in TF32 (`MLX_ENABLE_TF32`, default 1; ~1e-3
  // relative error). MLX reads the variable once, at its first product, so this runs before any; a
  // value the user set is kept (MLX_ENABLE_TF32=1 trades the precision for speed).
  setenv("MLX_ENABLE_TF32", "0", /*overwrite=*/0);
  static MLXDelegateBackend backend;
  static const Error status = executorch::runtime::register_backend({kBackendId, &backend});
  if (status != Error::Ok && executorch::runtime::get_backend_class(kBackendId) != &backend) {
    ET_LOG(Error, "%s: register_backend failed (error %d)", kBackendId, static_cast<int>(status));
    return false;
  }
  return true;
}

const std::string& last_error() { return t_last_error; }

}  // namespace mlxd::rt
