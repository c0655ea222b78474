#pragma once

#include <string>

namespace mlxd::rt {

// Must equal the AOT BackendDetails subclass name (mlx_delegate/backend).
constexpr const char* kBackendId = "MLXDelegateBackend";

// Registers the backend once per process; true when it is (or already was)
// registered. Safe to call repeatedly.
bool register_backend();

// Routes every ExecuTorch log line through printable() before the log sink in
// place now (the Python binding's, once it is loaded); idempotent. True when
// a sink is installed. register_backend() calls it.
bool install_printable_log_sink();

// The message of the last error this thread's delegate call reported.
const std::string& last_error();

}  // namespace mlxd::rt
