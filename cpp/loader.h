// Verifies a delegate payload and turns it into an immutable LoadedProgram,
// once, at init. Every id and size read from the payload is checked here so
// the interpreter can trust them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <executorch/runtime/core/named_data_map.h>

#include "ops_generated.h"
#include "runtime.h"

namespace mlxd::rt {

struct LoadError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct BoundConstant {
  uint32_t tid;
  mx::array value;
};

struct BufferSlot {
  uint32_t tid;
  int64_t update_tid;  // -1 when the graph never writes the buffer back
  mx::array initial;
  std::string name;  // printable (payload_name), for messages
};

struct LoadedProgram {
  std::vector<uint8_t> blob;  // owned copy: the tables below point into it
  const mlxd::Program* program = nullptr;
  std::vector<mlxd::Node> types;
  std::vector<const void*> nodes;
  // Tensor slots whose value is dead after instruction i (released early).
  std::vector<std::vector<uint32_t>> release_after;
  std::vector<BoundConstant> constants;
  std::unique_ptr<ConvertedConstants> converted;  // filled on demand by ExecContext::in_as
  std::vector<BufferSlot> buffers;
  std::string method;
};

// A method's constants, on the CPU, are copied at load into one arena of MLX memory whose whole 2 MiB
// pages are advised for transparent huge pages (Linux, MADV_HUGEPAGE) before the copy, each constant a
// view of its slice (where they add up to 4 MiB or more; mutable buffers of 4 MiB and more get memory of
// their own), instead of memory in 4 KiB pages: a decode step streams every weight once, and each 4 KiB
// page costs a TLB walk (in a VM a nested one). On by default; MLX_DELEGATE_HUGE_PAGES=0 at start-up or set_huge_page_constants(false)
// (read when a program loads) turns it off.
void set_huge_page_constants(bool on);
bool huge_page_constants();
// With huge pages on: all constants in one arena (on, the default; MLX_DELEGATE_CONSTANT_ARENA=0 at
// start-up turns it off) or only those of 4 MiB and more, each in memory of its own (off, for A/B runs).
void set_constant_arena(bool on);
bool constant_arena();

// Throws LoadError with a message naming the problem.
std::shared_ptr<const LoadedProgram> load_program(
    const void* data,
    size_t size,
    const executorch::runtime::NamedDataMap* named_data);

}  // namespace mlxd::rt
