// Runs a LoadedProgram for one delegate call. One Handle per loaded method:
// it owns the resident mutable buffers and serialises its own calls; distinct
// handles run in parallel.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/span.h>

#include "loader.h"

namespace mlxd::rt {

class Handle {
 public:
  explicit Handle(std::shared_ptr<const LoadedProgram> program);

  // Binds `args` (inputs then outputs), runs every node through MLX and
  // writes the outputs. Throws std::exception with a message naming the
  // input or node at fault. Mutable buffers keep their value when a call fails
  // before evaluation and restart from their initial value if evaluation fails.
  void execute(executorch::runtime::Span<executorch::runtime::EValue*> args);

  // Restores every mutable buffer to its initial value (e.g. a KV cache reset).
  void reset_buffers();

  const LoadedProgram& program() const { return *program_; }

 private:
  void bind_inputs(executorch::runtime::Span<executorch::runtime::EValue*> args);
  void run_nodes();
  void write_outputs(executorch::runtime::Span<executorch::runtime::EValue*> args);

  std::shared_ptr<const LoadedProgram> program_;
  std::vector<mx::array> buffers_;
  std::vector<mx::array> pinned_;  // inputs wrapped zero-copy: kept referenced so MLX never donates them
  std::mutex mutex_;
  ExecContext ctx_;
};

}  // namespace mlxd::rt
