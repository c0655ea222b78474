// Kernel chains (see kernel_chain.h): finding the runs in a traced graph, rebuilding the graph around
// them, and the primitive that evaluates one.
#include "kernel_chain.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}
std::atomic<bool> g_on{env_on("MLX_DELEGATE_KERNEL_CHAINS")};
std::atomic<bool> g_writes{env_on("MLX_DELEGATE_CHAIN_WRITES")};
std::atomic<bool> g_states{env_on("MLX_DELEGATE_CHAIN_STATES")};
std::atomic<uint64_t> g_chains{0}, g_members{0}, g_state_writes{0};

// A member's operand: the chain's input `index`, the output `index` of an earlier member (counted over
// all members' outputs in order), or the chain's constant `index`.
enum class From : uint8_t { input, value, constant };
struct Operand {
  From from;
  int index;
};

struct Member {
  std::shared_ptr<mx::Primitive> primitive;
  std::vector<Operand> in;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
};

// What a chain runs: its members, which member values are its outputs (value_output[v]: the output
// index, or -1 for an intermediate), and where each intermediate is read last. Shared with the task,
// which may run after MLX has let go of the primitive.
// Constants (weights, tables) are held here rather than as graph inputs: MLX gives each output of a
// primitive its own copy of the input list, and a step's one chain has ~60 outputs (its caches) and
// ~500 weights. output_alias[k]: the chain input that output k may update in place (a KV cache written by
// a member, cpu_kernel_in_place, that nothing else in the chain reads), or -1. value_state[v]: the chain
// input (an owned state, chain_cpu_kernels) whose memory value v is written into, or -1.
struct Plan {
  std::vector<Member> members;
  std::vector<int> value_output;
  std::vector<std::vector<int>> release_after;  // per member: the intermediates it reads last
  std::vector<mx::array> constants;
  std::vector<int> output_alias;
  std::vector<int> value_state;

  Plan(std::vector<Member> m, std::vector<int> outputs, std::vector<mx::array> c, std::vector<int> alias,
       std::vector<int> states)
      : members(std::move(m)), value_output(std::move(outputs)), constants(std::move(c)),
        output_alias(std::move(alias)), value_state(std::move(states)) {
    std::vector<int> last_use(value_output.size(), -1);
    for (int i = 0; i < static_cast<int>(members.size()); ++i)
      for (const auto& o : members[i].in)
        if (o.from == From::value) last_use[o.index] = i;
    release_after.resize(members.size());
    for (size_t v = 0; v < last_use.size(); ++v)
      if (last_use[v] >= 0 && value_output[v] < 0) release_after[last_use[v]].push_back(static_cast<int>(v));
  }

  // Each member as MLX would run it: its eval_cpu with the task recorded (buffers allocated, donation
  // decided: an intermediate is never donated, `values` holds it too), then the task. An intermediate's
  // buffer goes back once its last reader has run (a chain over a prefill's layers would otherwise hold
  // every layer's activations at once).
  void run(const std::vector<mx::array>& in, const std::vector<mx::array>& out) const {
    std::vector<mx::array> values;
    values.reserve(value_output.size());
    std::vector<std::function<void()>> tasks;
    std::vector<mx::array> args, results;
    for (int i = 0; i < static_cast<int>(members.size()); ++i) {
      const Member& m = members[i];
      args.clear();
      results.clear();
      for (const auto& o : m.in)
        args.push_back(o.from == From::value   ? values[o.index]
                       : o.from == From::input ? in[o.index]
                                               : constants[o.index]);
      for (size_t j = 0; j < m.shapes.size(); ++j) {
        const size_t v = values.size() + j;
        if (value_output[v] >= 0) {
          results.push_back(out[value_output[v]]);
          continue;
        }
        results.emplace_back(m.shapes[j], m.dtypes[j], nullptr, std::vector<mx::array>{});
        if (value_state[v] >= 0) results.back().copy_shared_buffer(in[value_state[v]]);  // updated in place
      }
      {
        CpuTaskRecording recording(tasks);
        m.primitive->eval_cpu(args, results);
      }
      for (auto& t : tasks) t();
      tasks.clear();
      args.clear();
      for (auto& r : results) values.push_back(std::move(r));
      // Moved out and dropped (the moved-from array holds nothing): the buffer goes back. Assigning an
      // array(0.f) placeholder allocated a scalar each time, and finding the last reads scanned every value
      // per member: ~140 us of a SmolLM2 decode step's 184-member chain.
      for (const int v : release_after[i]) mx::array(std::move(values[v]));
    }
  }
};

class KernelChain : public mx::Primitive {
 public:
  KernelChain(mx::Stream s, std::shared_ptr<const Plan> plan) : mx::Primitive(s), plan_(std::move(plan)) {}

  // The outputs get their buffers now (the nodes that read them take their pointers when MLX walks them,
  // before the task runs); the members run in one task on the stream thread. An output that may update
  // an input in place takes the input's buffer where nothing else holds it (the siblings' copies of the
  // input list dropped first, as RopeKvWriteCpu does outside a chain).
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    for (size_t v = 0; v < plan_->value_state.size(); ++v)
      if (const int s = plan_->value_state[v]; s >= 0 && !in[s].flags().row_contiguous)
        throw std::runtime_error("KernelChain: a state written in place is not row-contiguous");
    for (auto& o : out)
      if (&o.inputs() != &in) o.inputs().clear();
    for (size_t k = 0; k < out.size(); ++k) {
      const int a = plan_->output_alias[k];
      if (a >= 0 && in[a].flags().row_contiguous && in[a].nbytes() == out[k].nbytes() && in[a].is_donatable())
        out[k].copy_shared_buffer(in[a]);
      else
        out[k].set_data(mx::allocator::malloc(out[k].nbytes()));
    }
    // The task lets go of the arrays when it is done, ahead of the stream's completion signal: the caller
    // finds a state it owns donatable again at its next call (Handle::own_buffers).
    auto task = [plan = plan_, in = std::vector<mx::array>(in), out = std::vector<mx::array>(out)]() mutable {
      plan->run(in, out);
      in.clear();
      out.clear();
    };
    mx::cpu::get_command_encoder(stream()).dispatch(std::move(task));
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("KernelChain runs on the CPU only");
  }
  const char* name() const override { return "KernelChain"; }

 private:
  std::shared_ptr<const Plan> plan_;
};

// A node of the graph: a primitive, represented by its first output (the others are its siblings).
struct Node {
  mx::array a;
  bool chainable;
  int run = -1;  // the chain it joins, or -1
};

bool is_leaf(const mx::array& a) { return !a.has_primitive() || a.is_available(); }

// The graph's nodes, inputs before the nodes that read them (depth first, as MLX orders its tape).
std::vector<Node> topological(const std::vector<mx::array>& outputs, std::unordered_map<std::uintptr_t, int>& node_of) {
  std::vector<Node> nodes;
  std::vector<std::pair<mx::array, size_t>> stack;
  for (const auto& root : outputs) {
    if (is_leaf(root) || node_of.count(root.id())) continue;
    stack.emplace_back(root, 0);
    while (!stack.empty()) {
      auto& [a, next] = stack.back();
      if (next < a.inputs().size()) {
        const mx::array& x = a.inputs()[next++];
        if (!is_leaf(x) && !node_of.count(x.id())) {
          // Marked when pushed, so a node reached twice on the way down is visited once.
          for (const auto& o : x.outputs()) node_of[o.id()] = -1;
          stack.emplace_back(x, 0);
        }
        continue;
      }
      const int index = static_cast<int>(nodes.size());
      for (const auto& o : a.outputs()) node_of[o.id()] = index;
      auto& p = a.primitive();
      const bool chainable = p.stream().device == mx::Device::cpu && cpu_kernel_chainable(p.name()) &&
                             (kernel_chain_writes() || cpu_kernel_in_place(p.name()).empty());
      nodes.push_back({a, chainable});
      stack.pop_back();
    }
  }
  return nodes;
}

// The same nodes with those that depend on no chainable node (through any path) moved to the front, in
// their order: side computations such as a decode step's position mask then come before the kernels and
// no longer split a run. Still topological: a moved node's inputs are leaves or moved nodes.
void hoist_independent(std::vector<Node>& nodes, std::unordered_map<std::uintptr_t, int>& node_of) {
  std::vector<char> depends(nodes.size(), 0);
  for (size_t i = 0; i < nodes.size(); ++i) {
    depends[i] = nodes[i].chainable;
    for (const auto& x : nodes[i].a.inputs())
      if (auto it = node_of.find(x.id()); it != node_of.end() && it->second >= 0 && depends[it->second]) depends[i] = 1;
  }
  std::vector<Node> order;
  order.reserve(nodes.size());
  for (int pass = 0; pass < 2; ++pass)
    for (size_t i = 0; i < nodes.size(); ++i)
      if (depends[i] == pass) order.push_back(nodes[i]);
  nodes = std::move(order);
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i)
    for (const auto& o : nodes[i].a.outputs()) node_of[o.id()] = i;
}

bool is_constant(const mx::array& x) { return x.is_available() && !x.is_tracer(); }

}  // namespace

void set_kernel_chains(bool on) { g_on.store(on); }
void set_kernel_chain_writes(bool on) { g_writes.store(on); }
void set_kernel_chain_states(bool on) { g_states.store(on); }
bool kernel_chain_states() { return g_states.load(); }
bool kernel_chain_writes() { return g_writes.load(); }
bool kernel_chains() { return g_on.load(); }
KernelChainStats kernel_chain_stats() { return {g_chains.load(), g_members.load(), g_state_writes.load()}; }

std::vector<mx::array> chain_cpu_kernels(const std::vector<mx::array>& outputs, const std::vector<OwnedState>& states) {
  if (!kernel_chains()) return outputs;
  std::unordered_map<std::uintptr_t, int> node_of;
  std::vector<Node> nodes = topological(outputs, node_of);
  if (kernel_chain_writes()) hoist_independent(nodes, node_of);

  // Runs: maximal stretches of two or more chainable nodes in that order. Whatever feeds a run comes
  // before it, and whatever reads it after, so each run can stand as one node.
  std::vector<std::pair<int, int>> runs;  // [first, last] node
  for (int i = 0; i < static_cast<int>(nodes.size());) {
    int j = i;
    while (j < static_cast<int>(nodes.size()) && nodes[j].chainable) ++j;
    if (j - i >= 2) {
      for (int k = i; k < j; ++k) nodes[k].run = static_cast<int>(runs.size());
      runs.emplace_back(i, j - 1);
    }
    i = j == i ? i + 1 : j;
  }
  if (runs.empty()) return outputs;

  // A member output escapes its run when a node outside the run (read_outside) or the caller reads it.
  // sole_run: per array read, the one run all its readers belong to, or -1.
  std::unordered_map<std::uintptr_t, bool> escapes, read_outside;
  std::unordered_map<std::uintptr_t, int> sole_run;
  auto run_of = [&](const mx::array& x) {
    auto it = node_of.find(x.id());
    return it == node_of.end() || it->second < 0 ? -1 : nodes[it->second].run;
  };
  for (const auto& n : nodes)
    for (const auto& x : n.a.inputs()) {
      if (const int r = run_of(x); r >= 0 && r != n.run) escapes[x.id()] = read_outside[x.id()] = true;
      if (auto [it, added] = sole_run.emplace(x.id(), n.run); !added && it->second != n.run) it->second = -1;
    }
  std::unordered_map<std::uintptr_t, std::vector<size_t>> root_at;
  for (size_t k = 0; k < outputs.size(); ++k) {
    root_at[outputs[k].id()].push_back(k);
    if (run_of(outputs[k]) >= 0) escapes[outputs[k].id()] = true;
  }
  // Whether run r's write `o` of input `x` may stay out of the chain's outputs: x is an owned state that
  // only this run reads (the writing member once, checked by the caller) and the caller does not read;
  // o is read by no other node and returned only as x's new value.
  auto state_write = [&](const mx::array& o, const mx::array& x, int r) {
    if (!kernel_chain_states() || read_outside.count(o.id()) || root_at.count(x.id())) return false;
    if (auto it = sole_run.find(x.id()); it == sole_run.end() || it->second != r) return false;
    const auto at = root_at.find(o.id());
    if (at == root_at.end()) return false;
    for (const size_t k : at->second) {
      bool ok = false;
      for (const auto& s : states) ok |= s.output == k && s.state.id() == x.id();
      if (!ok) return false;
    }
    return true;
  };

  // The graph rebuilt in order: nodes reading a rebuilt array are made anew (same primitive), each run
  // becomes a chain whose outputs stand for the escaping arrays.
  std::unordered_map<std::uintptr_t, mx::array> remap;
  auto now = [&](const mx::array& x) -> const mx::array& {
    auto it = remap.find(x.id());
    return it == remap.end() ? x : it->second;
  };
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    const Node& n = nodes[i];
    if (n.run < 0) {
      bool changed = false;
      std::vector<mx::array> inputs;
      for (const auto& x : n.a.inputs()) {
        inputs.push_back(now(x));
        changed |= inputs.back().id() != x.id();
      }
      if (!changed) continue;
      auto olds = n.a.outputs();
      std::vector<mx::Shape> shapes;
      std::vector<mx::Dtype> dtypes;
      for (const auto& o : olds) shapes.push_back(o.shape()), dtypes.push_back(o.dtype());
      auto news = mx::array::make_arrays(std::move(shapes), dtypes, n.a.primitive_ptr(), inputs);
      for (size_t k = 0; k < olds.size(); ++k) remap.emplace(olds[k].id(), news[k]);
      continue;
    }
    const auto [first, last] = runs[n.run];
    const bool writes = kernel_chain_writes();
    std::vector<Member> members;
    std::vector<mx::array> inputs, escaping, constants;
    std::unordered_map<std::uintptr_t, int> input_of, value_of, constant_of;
    std::vector<int> value_output, input_reads, alias;
    for (int k = first; k <= last; ++k) {
      const mx::array& a = nodes[k].a;
      Member m{a.primitive_ptr(), {}, {}, {}};
      for (const auto& x : a.inputs()) {
        if (auto v = value_of.find(x.id()); v != value_of.end()) {
          m.in.push_back({From::value, v->second});
        } else if (writes && is_constant(x)) {
          auto [it, added] = constant_of.emplace(x.id(), static_cast<int>(constants.size()));
          if (added) constants.push_back(x);
          m.in.push_back({From::constant, it->second});
        } else {
          auto [it, added] = input_of.emplace(x.id(), static_cast<int>(inputs.size()));
          if (added) inputs.push_back(now(x)), input_reads.push_back(0);
          ++input_reads[it->second];
          m.in.push_back({From::input, it->second});
        }
      }
      const auto& in_place = cpu_kernel_in_place(a.primitive().name());
      const auto outs = a.outputs();  // a new vector (siblings and a itself)
      for (int j = 0; j < static_cast<int>(outs.size()); ++j) {
        const auto& o = outs[j];
        value_of.emplace(o.id(), static_cast<int>(value_output.size()));
        m.shapes.push_back(o.shape());
        m.dtypes.push_back(o.dtype());
        const bool out = escapes.count(o.id()) > 0;
        value_output.push_back(out ? static_cast<int>(escaping.size()) : -1);
        if (!out) continue;
        escaping.push_back(o);
        int from = -1;
        for (const auto& [output, input] : in_place)
          if (output == j && m.in[input].from == From::input) from = m.in[input].index;
        alias.push_back(from);
      }
      members.push_back(std::move(m));
    }
    // In place only where this member is the chain's one reader of that input.
    for (auto& a : alias)
      if (a >= 0 && input_reads[a] != 1) a = -1;
    // State writes leave the outputs (the chain keeps one output, so that evaluating the graph runs it).
    std::vector<int> value_state(value_output.size(), -1), renumber(escaping.size(), -1);
    int kept = 0;
    for (size_t k = 0; k < escaping.size(); ++k)
      if (alias[k] < 0 || !state_write(escaping[k], inputs[alias[k]], n.run)) renumber[k] = kept++;
    if (kept == 0 && !escaping.empty()) renumber[0] = kept++;
    for (size_t v = 0; v < value_output.size(); ++v) {
      if (const int k = value_output[v]; k >= 0 && renumber[k] < 0) {
        value_state[v] = alias[k];
        remap.emplace(escaping[k].id(), inputs[alias[k]]);
        g_state_writes.fetch_add(1, std::memory_order_relaxed);
      }
      if (value_output[v] >= 0) value_output[v] = renumber[value_output[v]];
    }
    for (size_t k = 0, to = 0; k < escaping.size(); ++k)
      if (renumber[k] >= 0) escaping[to] = escaping[k], alias[to++] = alias[k];
    escaping.erase(escaping.begin() + kept, escaping.end());
    alias.resize(kept);
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> dtypes;
    for (const auto& o : escaping) shapes.push_back(o.shape()), dtypes.push_back(o.dtype());
    const auto stream = nodes[first].a.primitive().stream();
    g_chains.fetch_add(1, std::memory_order_relaxed);
    g_members.fetch_add(members.size(), std::memory_order_relaxed);
    auto plan = std::make_shared<const Plan>(std::move(members), std::move(value_output), std::move(constants),
                                             std::move(alias), std::move(value_state));
    auto chain = std::make_shared<KernelChain>(stream, std::move(plan));
    auto news = mx::array::make_arrays(std::move(shapes), dtypes, chain, inputs);
    for (size_t k = 0; k < escaping.size(); ++k) remap.emplace(escaping[k].id(), news[k]);
    i = last;
  }
  std::vector<mx::array> result;
  result.reserve(outputs.size());
  for (const auto& root : outputs) result.push_back(now(root));
  return result;
}

}  // namespace mlxd::rt
