// Registers the delegate with the stock ExecuTorch runtime (libexecutorch.so
// from the executorch wheel) under the id the AOT side writes into .pte files.
#include "backend.h"

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/log.h>

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
  t_last_error = std::string(phase) + ": " + e.what();
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

}  // namespace

bool register_backend() {
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
