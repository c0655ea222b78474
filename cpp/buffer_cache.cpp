// MLX's buffer cache sized to the working set: see buffer_cache.h.
#include "buffer_cache.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <mutex>

#include <mlx/memory.h>

namespace mlxd::rt {

namespace mx = mlx::core;

namespace {

size_t default_cap() {
  if (const char* e = std::getenv("MLX_DELEGATE_BUFFER_CACHE_MB")) return size_t(std::strtoull(e, nullptr, 10)) << 20;
  return mx::get_memory_limit() / 4;
}

std::atomic<size_t> g_cap{default_cap()};
// The limit this module last set (0: not yet read from MLX); only raised.
std::atomic<size_t> g_limit{0};
std::mutex g_mutex;

}  // namespace

size_t buffer_cache_cap() { return g_cap.load(std::memory_order_relaxed); }
void set_buffer_cache_cap(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_cap.store(bytes);
  g_limit.store(0);  // re-read MLX's limit next time: someone else may have set it meanwhile
}

size_t buffer_cache_mark() { return mx::get_active_memory(); }

void fit_buffer_cache(size_t mark) {
  const size_t cap = g_cap.load(std::memory_order_relaxed);
  if (cap == 0) return;
  const size_t peak = mx::get_peak_memory();
  if (peak <= mark) return;
  const size_t want = std::min(cap, peak - mark);
  if (want <= g_limit.load(std::memory_order_relaxed)) return;  // the common case: nothing to do
  std::lock_guard<std::mutex> lock(g_mutex);
  size_t limit = g_limit.load();
  if (limit == 0) {  // MLX has no getter: read the limit by setting it
    limit = mx::set_cache_limit(std::numeric_limits<size_t>::max());
    mx::set_cache_limit(limit);
  }
  if (want > limit) {
    mx::set_cache_limit(want);
    limit = want;
  }
  g_limit.store(limit);
}

}  // namespace mlxd::rt
