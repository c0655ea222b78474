// Compiled graphs: the signature of a call, tracing the node list into an
// mx::compile'd function, and replaying it (see interpreter.h).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "interpreter.h"
#include "kernel_chain.h"

namespace mlxd::rt {
namespace {

using executorch::runtime::EValue;
using executorch::runtime::Span;

// Bit pattern of a scalar value, for signatures (int and float tagged apart).
int64_t value_word(const Value& v) {
  if (auto* i = std::get_if<int64_t>(&v)) return *i;
  if (auto* f = std::get_if<double>(&v)) {
    int64_t bits;
    std::memcpy(&bits, f, sizeof bits);
    return bits ^ int64_t(0x5bd1e9955bd1e995);
  }
  return std::numeric_limits<int64_t>::min();
}

// What exec_ItemNode would produce, read from an evaluated tensor.
Value item_value(const mx::array& x) {
  if (x.size() != 1) throw NodeError("item() needs a one-element tensor");
  mx::array v = mx::astype(x, mx::issubdtype(x.dtype(), mx::floating) ? mx::float32 : mx::int64);
  eval_follow_up({v});  // ahead of the stream's linger (stream_wait.h)
  if (v.dtype() == mx::float32) return static_cast<double>(v.item<float>());
  return v.item<int64_t>();
}

bool env_compile_enabled() {
  const char* v = std::getenv("MLX_DELEGATE_COMPILE");
  return v == nullptr || std::string(v) != "0";
}

std::atomic<bool> g_compile_enabled{env_compile_enabled()};
std::atomic<uint64_t> g_compiled_calls{0}, g_interpreted_calls{0}, g_traces{0}, g_rejected{0}, g_buffer_copies{0};

// A signature is compiled the second time it is seen: shapes seen once (a
// growing prompt, a KV cache that lengthens every step) never pay for tracing.
constexpr int kCompileAfter = 2;
// Signatures remembered per method; past this, unseen ones run node by node.
constexpr size_t kMaxSignatures = 64;

}  // namespace


bool compile_enabled() { return g_compile_enabled.load(std::memory_order_relaxed); }
void set_compile_enabled(bool on) { g_compile_enabled.store(on); }

CompileStats compile_stats() {
  return {g_compiled_calls.load(), g_interpreted_calls.load(), g_traces.load(), g_rejected.load()};
}

uint64_t owned_buffer_copies() { return g_buffer_copies.load(); }

void reset_compile_stats() {
  for (auto* c : {&g_compiled_calls, &g_interpreted_calls, &g_traces, &g_rejected}) c->store(0);
}

// Decides once whether the method can be traced: every item() must read a
// tensor that exists before the first instruction (so its value can be part of
// the signature); an item() of a computed tensor is a data-dependent value.
void Handle::plan_compile() {
  const auto& lp = *program_;
  if (lp.program->keep_intermediates()) {
    not_compilable_ = "keep_intermediates (early_release off) is a node-by-node debugging mode";
    return;
  }
  std::vector<bool> written(lp.program->num_tensors());
  struct Writes {
    std::vector<bool>& written;
    void tensor(uint32_t idx, bool out) { if (out) written[idx] = true; }
    void value(uint32_t, bool) {}
  } writes{written};
  for (size_t i = 0; i < lp.nodes.size(); ++i) {
    if (lp.types[i] == mlxd::Node::ItemNode) {
      const auto* x = static_cast<const mlxd::ItemNode*>(lp.nodes[i])->x();
      if (x == nullptr || written[x->idx()]) {
        not_compilable_ = "item() of a computed tensor (instruction " + std::to_string(i) + ")";
        return;
      }
      item_reads_.emplace_back(i, x->idx());
    }
    visit_slots(lp.types[i], lp.nodes[i], writes);
  }
}

// Input shapes, scalar inputs and the item() values: everything the traced
// graph's shapes and scalar values depend on (input dtypes are fixed by the
// export and checked in bind_inputs).
Handle::Signature Handle::signature() {
  const auto* p = program_->program;
  Signature sig;
  size_t n_in = p->inputs() ? p->inputs()->size() : 0;
  for (size_t i = 0; i < n_in; ++i) {
    const auto* s = p->inputs()->Get(i);
    if (s->kind() == mlxd::SlotKind::Tensor) {
      const auto& a = *ctx_.tensors[s->tid()->idx()];
      sig.push_back(a.ndim());
      sig.insert(sig.end(), a.shape().begin(), a.shape().end());
    } else {
      sig.push_back(value_word(ctx_.values[s->vid()->idx()]));
    }
  }
  item_values_.clear();
  for (const auto& [node, tid] : item_reads_) {
    item_values_.push_back(item_value(*ctx_.tensors[tid]));
    sig.push_back(value_word(item_values_.back()));
  }
  return sig;
}

// The traced function: (tensor inputs, buffer states) -> (tensor outputs,
// updated buffers). Constants are captured; scalar values come from this
// call's bound values, which the signature fixes.
std::vector<mx::array> Handle::trace(const std::vector<mx::array>& in, Graph& graph) {
  const auto& lp = *program_;
  const auto* p = lp.program;
  ExecContext ctx;
  ctx.tensors.assign(p->num_tensors(), std::nullopt);
  ctx.values = ctx_.values;  // scalar inputs
  graph.guards.clear();
  ctx.guards = &graph.guards;
  ctx.converted = lp.converted.get();
  size_t k = 0;
  size_t n_in = p->inputs() ? p->inputs()->size() : 0;
  for (size_t i = 0; i < n_in; ++i)
    if (const auto* s = p->inputs()->Get(i); s->kind() == mlxd::SlotKind::Tensor) ctx.tensors[s->tid()->idx()] = in[k++];
  for (const auto& c : lp.constants) ctx.tensors[c.tid] = c.value;
  for (const auto& b : lp.buffers) ctx.tensors[b.tid] = in[k++];
  size_t item = 0;
  for (size_t i = 0; i < lp.nodes.size(); ++i) {
    if (item < item_reads_.size() && item_reads_[item].first == i) {
      ctx.set_value(static_cast<const mlxd::ItemNode*>(lp.nodes[i])->out(), item_values_[item++]);
    } else {
      exec_node(i, ctx);
    }
    for (uint32_t t : lp.release_after[i]) ctx.tensors[t].reset();
  }
  std::vector<mx::array> outs;
  graph.value_outputs.clear();
  size_t n_out = p->outputs() ? p->outputs()->size() : 0;
  for (size_t i = 0; i < n_out; ++i) {
    const auto* s = p->outputs()->Get(i);
    if (s->kind() != mlxd::SlotKind::Tensor) {
      graph.value_outputs.push_back(ctx.int_value(s->vid()->idx()));
      continue;
    }
    mx::array a = *ctx.tensors[s->tid()->idx()];
    if (a.dtype() != to_mlx(s->dtype())) a = mx::astype(a, to_mlx(s->dtype()));
    outs.push_back(std::move(a));
  }
  // Updated buffers are the handle's own at every replay (own_buffers) where a chain may write one in place.
  std::vector<OwnedState> states;
  const size_t first_buffer = k - lp.buffers.size();
  for (size_t i = 0; i < lp.buffers.size(); ++i)
    if (lp.buffers[i].update_tid >= 0) {
      states.push_back({in[first_buffer + i], outs.size()});
      outs.push_back(*ctx.tensors[lp.buffers[i].update_tid]);
    }
  g_traces.fetch_add(1, std::memory_order_relaxed);
  outs = chain_cpu_kernels(outs, states);
  graph.writes_states = std::any_of(states.begin(), states.end(),
                                    [&](const OwnedState& s) { return outs[s.output].id() == s.state.id(); });
  return outs;
}

// Gives each buffer the graph may update in place memory of its own: a buffer that shares its memory (the
// program's initial value after a reset, a constant, another buffer, a view) is copied first, once.
void Handle::own_buffers() {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (program_->buffers[i].update_tid < 0) continue;
    auto& slot = ctx_.tensors[program_->buffers[i].tid];
    slot.reset();  // bind_inputs' reference: buffers_ must hold the only one
    if (!buffers_[i].is_donatable() || !buffers_[i].flags().row_contiguous) {
      buffers_[i] = owned_copy(buffers_[i]);
      g_buffer_copies.fetch_add(1, std::memory_order_relaxed);
    }
    slot = buffers_[i];
  }
}

// Runs the call through the compiled graph for its signature; false when the
// node-by-node path must run instead (signature new, or tracing failed).
bool Handle::run_compiled(Span<EValue*> args) {
  Signature sig = signature();
  auto it = graphs_.find(sig);
  if (it == graphs_.end()) {
    if (graphs_.size() >= kMaxSignatures) std::erase_if(graphs_, [](const auto& g) { return !g.second.fn; });
    if (graphs_.size() >= kMaxSignatures) return false;
    it = graphs_.emplace(std::move(sig), Graph{}).first;
  }
  Graph& graph = it->second;
  const bool tracing = !graph.fn;
  if (tracing) {
    if (++graph.seen < kCompileAfter) return false;
    graph.fn = mx::compile([this, &graph](const std::vector<mx::array>& in) { return trace(in, graph); });
  }
  // Chains (CPU only) may write buffers in place: owned before the trace, which may decide to.
  if (graph.writes_states || (tracing && mx::default_device() == mx::Device::cpu && kernel_chains()))
    own_buffers();

  const auto* p = program_->program;
  std::vector<mx::array> in;
  size_t n_in = p->inputs() ? p->inputs()->size() : 0;
  for (size_t i = 0; i < n_in; ++i)
    if (const auto* s = p->inputs()->Get(i); s->kind() == mlxd::SlotKind::Tensor) in.push_back(*ctx_.tensors[s->tid()->idx()]);
  in.insert(in.end(), buffers_.begin(), buffers_.end());
  std::vector<mx::array> outs;
  try {
    outs = graph.fn(in);
  } catch (const std::exception& e) {
    // MLX rejected the trace (e.g. a node evaluates a traced value): this call
    // runs node by node; execute() decides whether to give up compiling.
    trace_error_ = e.what();
    graphs_.erase(it);
    return false;
  }
  // Before anything is evaluated: a failed check leaves the buffers as they were.
  for (const auto& g : graph.guards)
    if (const auto& t = ctx_.tensors[g.tid]) check_index_guard(*t, g);
  // Only the graph may hold the buffers being replaced, so MLX can update them in place.
  ctx_.tensors.clear();
  in.clear();
  size_t n_results = outs.size() - std::count_if(program_->buffers.begin(), program_->buffers.end(),
                                                 [](const auto& b) { return b.update_tid >= 0; });
  std::vector<mx::array> updates(outs.begin() + n_results, outs.end());
  outs.erase(outs.begin() + n_results, outs.end());
  g_compiled_calls.fetch_add(1, std::memory_order_relaxed);
  finish(args, std::move(outs), std::move(updates), graph.value_outputs, graph.pace);
  return true;
}

void Handle::note_interpreted_call() {
  g_interpreted_calls.fetch_add(1, std::memory_order_relaxed);
  // The nodes ran fine where tracing failed: MLX cannot compile this method.
  if (!trace_error_.empty()) {
    not_compilable_ = "MLX could not trace it: " + trace_error_;
    graphs_.clear();
    g_rejected.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace mlxd::rt
