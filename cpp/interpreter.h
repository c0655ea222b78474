// Runs a LoadedProgram for one delegate call. One Handle per loaded method:
// it owns the resident mutable buffers and serialises its own calls; distinct
// handles run in parallel.
//
// Compiled graphs: when the same input signature (shapes, scalar inputs and
// the values item() reads from inputs or buffers) comes back, the node list is
// traced once into an `mx::compile`d function of (inputs, buffer states) ->
// (outputs, new buffer states) and replayed, instead of rebuilding the graph
// node by node. Programs MLX cannot trace fall back to the node-by-node path.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/span.h>

#include "loader.h"
#include "stream_wait.h"

namespace mlxd::rt {

// Process-wide compile switch: on unless MLX_DELEGATE_COMPILE=0 at start-up.
bool compile_enabled();
void set_compile_enabled(bool on);

// Process-wide counters (debug stats, read by tests and benchmarks).
struct CompileStats {
  uint64_t compiled_calls = 0;     // calls served by a compiled graph (the tracing call included)
  uint64_t interpreted_calls = 0;  // calls run node by node
  uint64_t traces = 0;             // graphs traced and compiled
  uint64_t rejected = 0;           // methods MLX could not trace (they stay on the node-by-node path)
};
CompileStats compile_stats();
void reset_compile_stats();
// Buffers copied so that a compiled graph may update them in place (Handle::own_buffers), process-wide.
uint64_t owned_buffer_copies();

// Per-node profiling (MLX_DELEGATE_PROFILE=1 at start-up, or set_profile):
// calls run node by node and each node's results are evaluated on their own,
// so the time it took is known. Slower than a normal call by design; the
// report groups nodes by kind, dtype and output shape.
bool profile_enabled();
void set_profile_enabled(bool on);
struct ProfileEntry {
  std::string key;  // "Linear f32 [1,1,576]"
  uint64_t calls = 0;
  double seconds = 0;
};
std::vector<ProfileEntry> profile_report();  // slowest first
void reset_profile();

// A copy of `a` in memory MLX owns, row-contiguous (a buffer value that would otherwise keep pointing at
// caller memory after the call, or share memory with another array).
mx::array owned_copy(const mx::array& a);

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

  // Why this method never compiles ("" when it may).
  const std::string& not_compilable() const { return not_compilable_; }

 private:
  using Signature = std::vector<int64_t>;
  using GraphFn = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;
  struct Graph {
    int seen = 0;  // calls with this signature so far
    GraphFn fn;    // empty until the signature comes back
    std::vector<int64_t> value_outputs;  // scalar outputs, fixed by the signature (set while tracing)
    std::vector<IndexGuard> guards;      // index checks on this call's inputs (set while tracing)
    bool writes_states = false;          // a kernel chain updates buffers in place (set while tracing)
    // How this graph's evaluations went lately (stream_wait.h): per signature, so a prefill's calls
    // do not enter the decode steps' timings (the OpenMP team's lending compares those).
    EvalPace pace;
  };

  void bind_inputs(executorch::runtime::Span<executorch::runtime::EValue*> args);
  void plan_compile();
  Signature signature();
  bool run_compiled(executorch::runtime::Span<executorch::runtime::EValue*> args);
  std::vector<mx::array> trace(const std::vector<mx::array>& in, Graph& graph);
  void exec_node(size_t i, ExecContext& ctx) const;
  void own_buffers();
  void run_nodes();
  void run_nodes_profiled();
  void profile_nodes(std::vector<mx::array>& produced);
  void reset_buffers_unlocked();  // reset_buffers() for a caller holding mutex_
  void note_interpreted_call();  // counts it; gives up compiling when this call's trace failed
  void write_outputs(executorch::runtime::Span<executorch::runtime::EValue*> args);
  // `pace`: the compiled graph's, or the method's (pace_) for a call run node by node.
  void finish(executorch::runtime::Span<executorch::runtime::EValue*> args, std::vector<mx::array> results,
              std::vector<mx::array> updates, const std::vector<int64_t>& value_outputs, EvalPace& pace);

  std::shared_ptr<const LoadedProgram> program_;
  std::vector<mx::array> buffers_;
  std::vector<mx::array> pinned_;  // inputs wrapped zero-copy: kept referenced so MLX never donates them
  std::mutex mutex_;
  ExecContext ctx_;

  // item() nodes whose operand is an input, constant or buffer: read before
  // tracing and made part of the signature, so the traced graph is valid.
  std::vector<std::pair<size_t, uint32_t>> item_reads_;  // (instruction, tensor slot)
  std::vector<Value> item_values_;                       // this call's values, in item_reads_ order
  std::string not_compilable_;
  std::string trace_error_;  // set when tracing failed in this call
  std::map<Signature, Graph> graphs_;
  EvalPace pace_;  // how long this method's evaluations run node by node took lately (stream_wait.h)
};

}  // namespace mlxd::rt
