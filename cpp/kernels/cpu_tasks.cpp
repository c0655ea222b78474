// The CPU kernels' task hand-off (begin_cpu_task / cpu_task_sink, recorded by kernel chains) and the
// registry of kernels a chain may hold; see cpu_parallel.h.
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "kernels/cpu_parallel.h"
#include <mlx/backend/cpu/encoder.h>

namespace mlxd::rt {

namespace {
thread_local std::vector<std::function<void()>>* t_recording = nullptr;
struct Chainable {
  const char* name;
  std::vector<std::pair<int, int>> in_place;
};
std::vector<Chainable>& chainable_kernels() {
  static std::vector<Chainable> kernels;
  return kernels;
}
const Chainable* find_chainable(const char* name) {
  for (const auto& k : chainable_kernels())
    if (std::strcmp(k.name, name) == 0) return &k;
  return nullptr;
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

bool cpu_kernel_chainable(const char* primitive_name) { return find_chainable(primitive_name) != nullptr; }

const std::vector<std::pair<int, int>>& cpu_kernel_in_place(const char* primitive_name) {
  static const std::vector<std::pair<int, int>> none;
  const Chainable* k = find_chainable(primitive_name);
  return k ? k->in_place : none;
}

ChainableKernel::ChainableKernel(const char* primitive_name, std::vector<std::pair<int, int>> in_place) {
  chainable_kernels().push_back({primitive_name, std::move(in_place)});
}

bool cpu_task_recording() { return t_recording != nullptr; }

}  // namespace mlxd::rt
