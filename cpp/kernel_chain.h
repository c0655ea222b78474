// Runs of the runtime's own CPU kernels in a traced graph, each folded into one MLX primitive.
//
// Why: MLX's CPU evaluation costs every graph array a step of the calling thread's walk and two
// stream tasks (the kernel's, and one that holds its inputs' buffers), whatever the array computes.
// On a 2-core machine the calling thread competes with the kernels' two threads: 246 extra view
// arrays slowed a SmolLM2 decode step by 15 % (~3.3 us each, 2026-11-28). A decode step was ~180
// kernel arrays. A chain records its members' tasks when MLX evaluates it and runs them in order in
// one task; the arrays between members never enter MLX's graph.
//
// A run is a stretch of the graph's topological order made only of chainable kernels
// (cpu_kernel_chainable); whatever a later node or the caller reads from it becomes one of the chain's
// outputs. Other nodes (MLX's own ops, views, the cache writes that update buffers in place) stay as
// they are and split runs.
#pragma once

#include <cstdint>
#include <vector>

#include <mlx/mlx.h>

namespace mlxd::rt {

// A mutable buffer of the traced graph: `state` (a graph input) holds its value before the call and
// outputs[output] its value after. The caller passes in only buffers it owns outright at every replay
// (nothing else holds their memory: not an initial value, not another buffer, not caller memory).
struct OwnedState {
  mlx::core::array state;
  size_t output;
};

// `outputs` computed through chains where runs of two or more kernels exist; `outputs` itself otherwise.
// Meant for a graph being traced for mx::compile (built once, replayed every call).
// A chain member's in-place write of a whole state (a KV cache) that only the caller reads afterwards
// leaves the chain's outputs: the chain writes into the state's memory and that output becomes `state`
// itself. Why: MLX gives each output of a primitive its own copy of the input list and of its siblings;
// a SmolLM2 decode step's chain had 61 outputs (60 caches) and 63 inputs, ~7,500 array copies made and
// dropped per step on the calling thread.
std::vector<mlx::core::array> chain_cpu_kernels(const std::vector<mlx::core::array>& outputs,
                                                const std::vector<OwnedState>& states = {});

// On by default; MLX_DELEGATE_KERNEL_CHAINS=0 or set_kernel_chains(false) turns chains off for graphs
// traced afterwards (A/B runs in one process).
void set_kernel_chains(bool on);
bool kernel_chains();

// On by default; MLX_DELEGATE_CHAIN_WRITES=0 or set_kernel_chain_writes(false) keeps the kernels that
// update an input in place (the KV-cache writes) out of chains, and each chain's weights among its graph
// inputs, as before (A/B runs in one process; graphs traced afterwards).
void set_kernel_chain_writes(bool on);
bool kernel_chain_writes();

// On by default; MLX_DELEGATE_CHAIN_STATES=0 or set_kernel_chain_states(false) keeps every state write
// among its chain's outputs (A/B runs in one process; graphs traced afterwards).
void set_kernel_chain_states(bool on);
bool kernel_chain_states();

// Chains built, kernels folded into them and state writes taken out of their outputs, since the process
// started (tests prove chains ran).
struct KernelChainStats {
  uint64_t chains = 0, members = 0, state_writes = 0;
};
KernelChainStats kernel_chain_stats();

}  // namespace mlxd::rt
