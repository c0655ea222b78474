// Per-node profiling (MLX_DELEGATE_PROFILE=1): see interpreter.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include "interpreter.h"

namespace mlxd::rt {

namespace {

bool env_profile_enabled() {
  const char* v = std::getenv("MLX_DELEGATE_PROFILE");
  return v != nullptr && std::string(v) == "1";
}
std::atomic<bool> g_profile{env_profile_enabled()};
std::mutex g_profile_mutex;
std::map<std::string, ProfileEntry> g_profile_entries;

std::string profile_key(mlxd::Node type, const std::vector<mx::array>& produced) {
  std::string key = kNodeNames[static_cast<int>(type)];
  if (produced.empty()) return key;
  const auto& a = produced.front();
  std::ostringstream os;
  os << key << ' ' << a.dtype() << " [";
  for (size_t d = 0; d < a.shape().size(); ++d) os << (d ? "," : "") << a.shape()[d];
  os << ']';
  return os.str();
}

}  // namespace

bool profile_enabled() { return g_profile.load(std::memory_order_relaxed); }
void set_profile_enabled(bool on) { g_profile.store(on); }

std::vector<ProfileEntry> profile_report() {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  std::vector<ProfileEntry> out;
  for (const auto& [key, e] : g_profile_entries) out.push_back(e);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  return out;
}

void reset_profile() {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  g_profile_entries.clear();
}

void Handle::run_nodes_profiled() {
  const auto& lp = *program_;
  std::vector<mx::array> produced;
  ctx_.produced = &produced;
  struct Reset {
    ExecContext& c;
    ~Reset() { c.produced = nullptr; }
  } reset{ctx_};
  end_linger();  // every node is evaluated on its own: none should queue behind a linger
  // As in a normal call, only the graph may hold a buffer being replaced and each
  // slot is dropped after its last reader before that reader is evaluated, so MLX
  // updates a KV cache in place here too (holding them made every cache write
  // show up as a copy of the whole cache). The old contents are then consumed as
  // the nodes run: a failure restarts the buffers from their initial values.
  for (const auto& b : lp.buffers)
    if (b.update_tid >= 0) buffers_[&b - lp.buffers.data()] = b.initial;
  try {
    profile_nodes(produced);
  } catch (...) {
    reset_buffers_unlocked();
    throw;
  }
}

void Handle::profile_nodes(std::vector<mx::array>& produced) {
  const auto& lp = *program_;
  for (size_t i = 0; i < lp.nodes.size(); ++i) {
    produced.clear();
    auto t0 = std::chrono::steady_clock::now();
    exec_node(i, ctx_);
    if (!lp.program->keep_intermediates())
      for (uint32_t t : lp.release_after[i]) ctx_.tensors[t].reset();
    mx::eval(produced);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(g_profile_mutex);
      auto key = profile_key(lp.types[i], produced);
      auto& e = g_profile_entries[key];
      e.key = key;
      e.calls += 1;
      e.seconds += dt;
    }
  }
}

}  // namespace mlxd::rt
