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

// `outputs` computed through chains where runs of two or more kernels exist; `outputs` itself otherwise.
// Meant for a graph being traced for mx::compile (built once, replayed every call).
std::vector<mlx::core::array> chain_cpu_kernels(const std::vector<mlx::core::array>& outputs);

// On by default; MLX_DELEGATE_KERNEL_CHAINS=0 or set_kernel_chains(false) turns chains off for graphs
// traced afterwards (A/B runs in one process).
void set_kernel_chains(bool on);
bool kernel_chains();

// On by default; MLX_DELEGATE_CHAIN_WRITES=0 or set_kernel_chain_writes(false) keeps the kernels that
// update an input in place (the KV-cache writes) out of chains, and each chain's weights among its graph
// inputs, as before (A/B runs in one process; graphs traced afterwards).
void set_kernel_chain_writes(bool on);
bool kernel_chain_writes();

// Chains built and kernels folded into them, since the process started (tests prove chains ran).
struct KernelChainStats {
  uint64_t chains = 0, members = 0;
};
KernelChainStats kernel_chain_stats();

}  // namespace mlxd::rt
