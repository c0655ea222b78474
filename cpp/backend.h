#pragma once

#include <string>

namespace mlxd::rt {

// Must equal the AOT BackendDetails subclass name (mlx_delegate/backend).
constexpr const char* kBackendId = "MLXDelegateBackend";

// Registers the backend once per process; true when it is (or already was)
// registered. Safe to call repeatedly.
bool register_backend();

// The message of the last error this thread's delegate call reported.
const std::string& last_error();

}  // namespace mlxd::rt
