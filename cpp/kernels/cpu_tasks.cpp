// The CPU kernels' task hand-off (begin_cpu_task / cpu_task_sink, recorded by kernel chains) and the
// registry of kernels a chain may hold; see cpu_parallel.h.
#include <cstring>
#include <functional>
#include <vector>

#include "kernels/cpu_parallel.h"
#include <mlx/backend/cpu/encoder.h>

namespace mlxd::rt {

namespace {
thread_local std::vector<std::function<void()>>* t_recording = nullptr;
std::vector<const char*>& chainable_names() {
  static std::vector<const char*> names;
  return names;
}
}  // namespace

CpuTaskSink& cpu_task_sink(const mlx::core::Stream& s) {
  thread_local CpuTaskSink sink;
  sink.recorded_ = t_recording;
  sink.encoder_ = t_recording ? nullptr : &mlx::core::cpu::get_command_encoder(s);
  return sink;
}

CpuTaskRecording::CpuTaskRecording(std::vector<std::function<void()>>& tasks) : saved_(t_recording) {
  t_recording = &tasks;
}
CpuTaskRecording::~CpuTaskRecording() { t_recording = saved_; }

CpuTaskSink& begin_cpu_task(const mlx::core::Stream& s, const std::vector<mlx::core::array>&,
                            mlx::core::array& out, bool has_buffer) {
  // MLX's CPU encoder keeps no record of a task's arrays (set_input_array is a no-op there). An output
  // may have its buffer already: a kernel chain's output (kernel_chain.cpp).
  if (!has_buffer && !out.data_shared_ptr()) out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  return cpu_task_sink(s);
}

bool cpu_kernel_chainable(const char* primitive_name) {
  for (const char* n : chainable_names())
    if (std::strcmp(n, primitive_name) == 0) return true;
  return false;
}

ChainableKernel::ChainableKernel(const char* primitive_name) { chainable_names().push_back(primitive_name); }

}  // namespace mlxd::rt
