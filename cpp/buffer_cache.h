// MLX's buffer cache, sized to the calls' working set.
//
// MLX's CPU allocator keeps freed buffers for reuse only up to its cache limit
// (32 MB by default on Linux). A call whose intermediates exceed it (a CNN at
// batch 8: ~350 MB) hands the rest back to the system allocator at the end of
// every call and gets fresh pages on the next: ResNet-50 at batch 8 took
// 67-80k page faults and ~13 % of its wall time per call for them. So after
// each call the cache limit is raised, never lowered, to the largest working
// set seen (the peak above what was resident before the call), up to a cap.
#pragma once

#include <cstddef>

namespace mlxd::rt {

// Call before evaluating a call's graph; pass the result to fit_buffer_cache after it.
size_t buffer_cache_mark();
void fit_buffer_cache(size_t mark);

// The cap in bytes (MLX_DELEGATE_BUFFER_CACHE_MB at start-up; default a quarter
// of MLX's memory limit; 0 leaves MLX's cache limit alone).
size_t buffer_cache_cap();
void set_buffer_cache_cap(size_t bytes);

}  // namespace mlxd::rt
