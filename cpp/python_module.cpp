// Python entry point: `mlx_delegate._runtime`. Importing it registers the
// backend with the executorch wheel's runtime.
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <executorch/runtime/core/named_data_map.h>

#include <mlx/memory.h>

#include "backend.h"
#include "interpreter.h"
#include "kernel_chain.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_cpu.h"
#include "kernels/conv_cpu.h"
#include "kernels/winograd_cpu.h"
#include "kernels/cpu_parallel.h"
#include "kernels/linear_cpu.h"
#include "kernels/qgemv_cpu.h"
#include "kernels/rope_kv_cpu.h"
#include "loader.h"
#include "buffer_cache.h"
#include "stream_wait.h"

namespace nb = nanobind;
using namespace mlxd::rt;

namespace {

// A NamedDataMap over Python-owned bytes, for checking payloads without a .pte.
class DictDataMap final : public executorch::runtime::NamedDataMap {
 public:
  explicit DictDataMap(std::map<std::string, std::string> data) : data_(std::move(data)) {}
  executorch::runtime::Result<const executorch::runtime::TensorLayout> get_tensor_layout(
      std::string_view) const override {
    return executorch::runtime::Error::NotImplemented;
  }
  executorch::runtime::Result<executorch::runtime::FreeableBuffer> get_data(std::string_view key) const override {
    auto it = data_.find(std::string(key));
    if (it == data_.end()) return executorch::runtime::Error::NotFound;
    return executorch::runtime::FreeableBuffer(it->second.data(), it->second.size(), nullptr);
  }
  executorch::runtime::Error load_data_into(std::string_view, void*, size_t) const override {
    return executorch::runtime::Error::NotImplemented;
  }
  executorch::runtime::Result<uint32_t> get_num_keys() const override { return uint32_t(data_.size()); }
  executorch::runtime::Result<const char*> get_key(uint32_t i) const override {
    if (i >= data_.size()) return executorch::runtime::Error::InvalidArgument;
    return std::next(data_.begin(), i)->first.c_str();
  }

 private:
  std::map<std::string, std::string> data_;
};

// {name: bytes} from Python as the named data map a .pte would provide.
DictDataMap data_map(const nb::dict& named_data) {
  std::map<std::string, std::string> data;
  for (auto [key, value] : named_data) {
    nb::bytes b = nb::cast<nb::bytes>(value);
    data.emplace(nb::cast<std::string>(key), std::string(b.c_str(), b.size()));
  }
  return DictDataMap(std::move(data));
}

// Loads (verifies) a payload; raises ValueError naming the problem.
void check_payload(nb::bytes payload, nb::dict named_data) {
  DictDataMap map = data_map(named_data);
  try {
    auto lp = load_program(payload.c_str(), payload.size(), &map);
    (void)lp;
  } catch (const std::exception& e) {
    throw nb::value_error(printable(e.what()).c_str());
  }
}

namespace et = executorch::aten;

// ExecuTorch scalar type for each IR dtype (indexed by mlxd::DType); u16..u64
// have no ExecuTorch tensor type.
constexpr et::ScalarType kScalarTypes[] = {
    et::ScalarType::Float, et::ScalarType::Half,  et::ScalarType::BFloat16, et::ScalarType::Double,
    et::ScalarType::Char,  et::ScalarType::Short, et::ScalarType::Int,      et::ScalarType::Long,
    et::ScalarType::Byte,  et::ScalarType::Undefined, et::ScalarType::Undefined, et::ScalarType::Undefined,
    et::ScalarType::Bool};
static_assert(std::size(kScalarTypes) == size_t(mlxd::DType::MAX) + 1);

// A contiguous ExecuTorch tensor over memory this object owns.
struct OwnedTensor {
  std::vector<et::SizesType> sizes;
  std::vector<et::DimOrderType> dim_order;
  std::vector<et::StridesType> strides;
  std::string data;
  std::unique_ptr<et::TensorImpl> impl;

  OwnedTensor(mlxd::DType dtype, std::vector<et::SizesType> shape, std::string bytes)
      : sizes(std::move(shape)), dim_order(sizes.size()), strides(sizes.size()), data(std::move(bytes)) {
    std::iota(dim_order.begin(), dim_order.end(), et::DimOrderType(0));
    int64_t stride = 1;
    for (size_t d = sizes.size(); d-- > 0;) {
      strides[d] = static_cast<et::StridesType>(stride);
      stride *= sizes[d];
    }
    impl = std::make_unique<et::TensorImpl>(kScalarTypes[int(dtype)], ssize_t(sizes.size()), sizes.data(),
                                            data.data(), dim_order.data(), strides.data(),
                                            et::TensorShapeDynamism::DYNAMIC_BOUND);
  }
};

mlxd::DType dtype_named(const std::string& name) {
  for (int d = 0; d <= int(mlxd::DType::MAX); ++d)
    if (name == mlxd::EnumNameDType(mlxd::DType(d)) && kScalarTypes[d] != et::ScalarType::Undefined)
      return mlxd::DType(d);
  throw nb::value_error(("unsupported dtype '" + name + "'").c_str());
}

// Output capacity: every dimension at its exported upper bound when that fits
// in `cap` bytes, else at its lower bound (a larger result is then an error).
std::vector<et::SizesType> output_sizes(const mlxd::IOSlot* s, size_t cap) {
  std::vector<et::SizesType> hi, lo;
  size_t bytes = to_mlx(s->dtype()).size();
  if (s->shape() == nullptr) return hi;
  for (const auto* d : *s->shape()) {
    int64_t upper = d->dynamic() ? d->max() : d->size();
    int64_t lower = d->dynamic() ? d->min() : d->size();
    bytes = upper > 0 && bytes > cap / size_t(upper) ? cap + 1 : bytes * size_t(std::max<int64_t>(upper, 0));
    hi.push_back(et::SizesType(std::min<int64_t>(upper, INT32_MAX)));
    lo.push_back(et::SizesType(std::min<int64_t>(lower, INT32_MAX)));
  }
  if (bytes <= cap) return hi;
  size_t low_bytes = to_mlx(s->dtype()).size();
  for (auto d : lo) low_bytes = d && low_bytes > cap / size_t(d) ? cap + 1 : low_bytes * size_t(d);
  if (low_bytes > cap) throw nb::value_error("output is larger than max_output_bytes");
  return lo;
}

using TensorArg = std::tuple<std::string, std::vector<int32_t>, nb::bytes>;  // (dtype, shape, data)

// Loads a payload and runs it once on `inputs` (TensorArg, int or float each),
// without ExecuTorch's program machinery: the fuzzer's entry point. Returns the
// outputs (TensorArg or int). Every failure is a ValueError naming the problem.
std::vector<nb::object> run_payload(nb::bytes payload, nb::dict named_data, nb::list inputs,
                                    size_t max_output_bytes) {
  DictDataMap map = data_map(named_data);
  std::vector<std::unique_ptr<OwnedTensor>> tensors;
  std::vector<executorch::runtime::EValue> values;
  try {
    Handle handle(load_program(payload.c_str(), payload.size(), &map));
    const auto* p = handle.program().program;
    for (nb::handle x : inputs) {
      if (nb::isinstance<nb::int_>(x)) values.emplace_back(nb::cast<int64_t>(x));
      else if (nb::isinstance<nb::float_>(x)) values.emplace_back(nb::cast<double>(x));
      else {
        auto [name, shape, data] = nb::cast<TensorArg>(x);
        mlxd::DType dtype = dtype_named(name);
        size_t n = to_mlx(dtype).size();
        for (int32_t d : shape) n = d < 0 ? SIZE_MAX : n * size_t(d);
        if (n != data.size()) throw nb::value_error("input data size does not match its shape and dtype");
        tensors.push_back(std::make_unique<OwnedTensor>(
            dtype, std::vector<et::SizesType>(shape.begin(), shape.end()), std::string(data.c_str(), data.size())));
        values.emplace_back(et::Tensor(tensors.back()->impl.get()));
      }
    }
    size_t n_out = p->outputs() ? p->outputs()->size() : 0;
    std::vector<OwnedTensor*> outs;
    for (size_t i = 0; i < n_out; ++i) {
      const auto* s = p->outputs()->Get(i);
      if (s->kind() != mlxd::SlotKind::Tensor || kScalarTypes[int(s->dtype())] == et::ScalarType::Undefined) {
        values.emplace_back();
        outs.push_back(nullptr);
        continue;
      }
      auto sizes = output_sizes(s, max_output_bytes);
      size_t n = std::accumulate(sizes.begin(), sizes.end(), size_t(1),
                                 [](size_t a, et::SizesType b) { return a * size_t(b); });
      tensors.push_back(std::make_unique<OwnedTensor>(s->dtype(), std::move(sizes),
                                                      std::string(n * to_mlx(s->dtype()).size(), '\0')));
      values.emplace_back(et::Tensor(tensors.back()->impl.get()));
      outs.push_back(tensors.back().get());
    }
    std::vector<executorch::runtime::EValue*> args;
    for (auto& v : values) args.push_back(&v);
    {
      nb::gil_scoped_release release;
      handle.execute({args.data(), args.size()});
    }
    std::vector<nb::object> result;
    for (size_t i = 0; i < n_out; ++i) {
      const auto& v = values[values.size() - n_out + i];
      if (outs[i] == nullptr) {
        result.push_back(v.isInt() ? nb::cast(v.toInt()) : nb::none());
        continue;
      }
      const auto& t = v.toTensor();
      std::vector<int32_t> shape(t.sizes().begin(), t.sizes().end());
      result.push_back(nb::cast(TensorArg(mlxd::EnumNameDType(p->outputs()->Get(i)->dtype()), shape,
                                          nb::bytes(outs[i]->data.data(), t.nbytes()))));
    }
    return result;
  } catch (const nb::python_error&) {
    throw;
  } catch (const nb::builtin_exception&) {
    throw;
  } catch (const std::exception& e) {
    throw nb::value_error(printable(e.what()).c_str());
  }
}

}  // namespace

NB_MODULE(_runtime, m) {
  m.doc() = "mlx_delegate C++ runtime";
  m.def("register_backend", &register_backend, "Register the backend with ExecuTorch (idempotent).");
  m.def("backend_id", [] { return std::string(kBackendId); });
  m.def("schema_version", [] { return kSchemaVersion; });
  m.def("install_log_sink", &install_printable_log_sink,
        "Route ExecuTorch log lines through printable() before the current sink (idempotent).");
  m.def("printable", [](nb::bytes text, size_t cap) { return printable(std::string_view(text.c_str(), text.size()), cap); },
        nb::arg("text"), nb::arg("cap") = kMaxMessageChars,
        "Text as the runtime logs payload strings: printable ASCII, other bytes as \\xNN, at most cap chars.");
  m.def("last_error", [] { return last_error(); }, "Message of this thread's last delegate error.");
  m.def("check_payload", &check_payload, nb::arg("payload"), nb::arg("named_data") = nb::dict(),
        "Verify and load a delegate payload; raises ValueError naming the problem.");
  m.def("run_payload", &run_payload, nb::arg("payload"), nb::arg("named_data"), nb::arg("inputs"),
        nb::arg("max_output_bytes") = size_t(1) << 28,
        "Load a payload and run it once on (dtype, shape, bytes) / int / float inputs (fuzzing and tests).");
  m.def("set_max_tensor_bytes", &set_max_tensor_bytes, nb::arg("bytes"),
        "Largest tensor a node may produce (0: physical memory).");
  m.def("max_tensor_bytes", &max_tensor_bytes);
  m.def("peak_memory", [] { return mlx::core::get_peak_memory(); }, "MLX peak memory (bytes) since the last reset.");
  m.def("reset_peak_memory", [] { mlx::core::reset_peak_memory(); });
  m.def("active_memory", [] { return mlx::core::get_active_memory(); });
  m.def("set_compile", &set_compile_enabled, nb::arg("on"),
        "Turn compiled graphs on or off process-wide (MLX_DELEGATE_COMPILE=0 starts with them off).");
  m.def("compile_enabled", &compile_enabled);
  m.def("compile_stats", [] {
    auto s = compile_stats();
    return std::map<std::string, uint64_t>{{"compiled_calls", s.compiled_calls},
                                           {"interpreted_calls", s.interpreted_calls},
                                           {"traces", s.traces}, {"rejected", s.rejected}};
  }, "Process-wide counters: calls served by compiled graphs or node by node, graphs traced, methods rejected.");
  m.def("owned_buffer_copies", &owned_buffer_copies,
        "Process-wide: mutable buffers copied so that a compiled graph may update them in place.");
  m.def("reset_compile_stats", &reset_compile_stats);
  m.def("set_kernel_chains", &mlxd::rt::set_kernel_chains, nb::arg("on"),
        "Fold runs of the runtime's CPU kernels in graphs traced from now on into one MLX primitive each "
        "(on by default; MLX_DELEGATE_KERNEL_CHAINS=0 starts with it off).");
  m.def("kernel_chains", &mlxd::rt::kernel_chains);
  m.def("set_kernel_chain_writes", &mlxd::rt::set_kernel_chain_writes, nb::arg("on"),
        "KV-cache writes as chain members, weights held by their chain (graphs traced afterwards).");
  m.def("kernel_chain_writes", &mlxd::rt::kernel_chain_writes);
  m.def("set_kernel_chain_states", &mlxd::rt::set_kernel_chain_states, nb::arg("on"),
        "Chains write owned buffers (KV caches) in place, out of their outputs (graphs traced afterwards).");
  m.def("kernel_chain_states", &mlxd::rt::kernel_chain_states);
  m.def("kernel_chain_stats", [] {
    auto s = mlxd::rt::kernel_chain_stats();
    return std::map<std::string, uint64_t>{{"chains", s.chains}, {"members", s.members},
                                                 {"state_writes", s.state_writes}};
  }, "Process-wide counters: kernel chains built by traces, and the kernels folded into them.");
  m.def("set_profile", &set_profile_enabled, nb::arg("on"),
        "Per-node profiling: calls run node by node, each node evaluated and timed on its own.");
  m.def("profile_enabled", &profile_enabled);
  m.def("profile_report", [] {
    nb::list out;
    for (const auto& e : profile_report()) out.append(nb::make_tuple(e.key, e.calls, e.seconds));
    return out;
  }, "(node kind, dtype and shape, calls, seconds) rows, slowest first.");
  m.def("reset_profile", &reset_profile);
  m.def("cpu_kernel_calls", &mlxd::rt::qgemv_cpu_calls,
        "How many times the CPU quantized GEMV kernel has run (MLX_DELEGATE_CPU_KERNELS=0 turns it off).");
  m.def("constant_conversions", &mlxd::rt::constant_conversions,
        "How many constants (e.g. fp16 quantization scales for MLX's kernels) the runtime has converted to "
        "another dtype: once per loaded program and dtype, never per call.");
  m.def("set_qgemv_group32_path", &mlxd::rt::qgemv_cpu_set_group32_path, nb::arg("on"),
        "Turn the quantized GEMV's one-row path for groups of 32 on (default) or off, from the next call "
        "on (parity tests, A/B timings).");
  m.def("set_qgemv_guided_split", &mlxd::rt::qgemv_cpu_set_guided_split, nb::arg("on"),
        "Decode-sized quantized products split their rows into pieces claimed from one counter that shrink as "
        "the product ends (on; opt-in: MLX_DELEGATE_QGEMV_GUIDED=1 at start-up) or four equal parts per thread "
        "(off, the default).");
  m.def("qgemv_guided_split", &mlxd::rt::qgemv_cpu_guided_split);
  m.def("set_qgemv_one_row_block", &mlxd::rt::qgemv_cpu_set_one_row_block, nb::arg("rows"),
        "Weight rows per step of the AVX-512 quantized GEMV for one row of x: 1, 2 or 4 (by default 4 on Intel "
        "processors, 1 elsewhere; MLX_DELEGATE_QGEMV_ROWS at start-up), from the next call on. Returns the "
        "previous value.");
  m.def("set_sdpa_row_loops", &mlxd::rt::fused_sdpa_cpu_set_row_loops, nb::arg("on"),
        "Turn the decode attention's AVX-512 row loops (fp32 k / v, D a multiple of 16 up to 128) on (default) "
        "or off (the per-key loops run), from the next call on (parity tests, A/B timings).");
  m.def("set_rope_kv_packed", &mlxd::rt::rope_kv_write_cpu_set_packed, nb::arg("on"),
        "RoPE + cache writes read q, k and v sliced from one projection in place (on, default) or through "
        "their slice and reshape nodes (off), for graphs built from now on (A/B timings).");
  m.def("set_qgemv_avx512_path", &mlxd::rt::qgemv_cpu_set_avx512_path, nb::arg("on"),
        "Turn the quantized GEMV's AVX-512 VNNI kernels on (default, where the CPU has them) or off (the AVX2 "
        "kernels run), from the next call on (parity tests, A/B timings).");
  m.def("cpu_kernel_call_counts", &mlxd::rt::cpu_kernel_call_counts,
        "Calls of the CPU element-wise / row kernels by name (softmax, rms_norm, silu, ...); "
        "MLX_DELEGATE_CPU_KERNELS=0 turns them off.");
  m.def("set_cpu_kernels", &mlxd::rt::set_cpu_kernels_enabled, nb::arg("on"),
        "Turn the CPU element-wise / row kernels on or off for graphs built from now on (A/B runs).");
  m.def("cpu_kernels_enabled", &mlxd::rt::cpu_kernels_enabled);
  m.def("set_blas_split", &mlxd::rt::set_blas_split, nb::arg("on"),
        "Cut large fp32 products into single-threaded MKL blocks on the runtime's helper pool (on by default; "
        "MLX_DELEGATE_BLAS_SPLIT=0 starts with it off) instead of MKL's OpenMP team. Returns whether it is on "
        "(false when MLX's sgemm is not routed to torch's BLAS).");
  m.def("set_conv_tiles", &mlxd::rt::set_conv_tiles, nb::arg("on"),
        "CPU convolutions in tiles of output rows (large products: each tile's im2col and sgemm on one thread in "
        "cache) or blocks of output channels (smaller one-image products: bias, sgemm and clamp in one task), "
        "and small-map depthwise convolutions on a padded grid, instead of whole-image passes (on by default; MLX_DELEGATE_CONV_TILES=0 starts with them off), from the "
        "next call on.");
  m.def("conv_tiles", &mlxd::rt::conv_tiles);
  m.def("set_conv_direct", &mlxd::rt::set_conv_direct, nb::arg("on"),
        "Turn the direct path for convolutions of up to four input channels (stems) on or off.");
  m.def("conv_direct", &mlxd::rt::conv_direct);
  m.def("set_conv_winograd", &mlxd::rt::set_conv_winograd, nb::arg("mode"),
        "3x3 stride-1 CPU convolutions as Winograd F(m x m, 3 x 3): 0 off (im2col + sgemm), 1 where the measured "
        "gate says it wins (default; MLX_DELEGATE_CONV_WINOGRAD sets the start value), 2 / 4 F(2x2) / F(4x4) on "
        "every such convolution (tests, per-layer timings), from the next call on. Returns the previous mode.");
  m.def("conv_winograd", &mlxd::rt::conv_winograd);
  m.def("set_block_tiling", &mlxd::rt::set_block_tiling, nb::arg("channels_kb") = -1, nb::arg("tile_kb") = 0,
        "The inverted-residual CPU kernel's size limits in KiB (A/B runs, tests): maps whose expanded activation "
        "takes at most channels_kb run whole, split over channel blocks (0: never; default 1024, "
        "MLX_DELEGATE_BLOCK_CHANNELS_KB), larger ones in row bands walked in tiles of at most tile_kb of buffers "
        "per thread (default 1024, MLX_DELEGATE_BLOCK_TILE_KB). -1 / 0 keeps a limit. Returns the previous "
        "(channels_kb, tile_kb).");
  m.def("set_linear_kernel", &mlxd::rt::set_linear_cpu, nb::arg("on"),
        "fp32 linears on the CPU as one kernel, the bias and a fused residual added to each output block in cache "
        "(on by default; MLX_DELEGATE_LINEAR_KERNEL=0 starts with it off) instead of MLX's matmul and broadcast adds; read "
        "while a graph is built. Returns the previous setting.");
  m.def("linear_kernel", &mlxd::rt::linear_cpu_enabled);
  m.def("set_pool_spin_yield", &mlxd::rt::set_pool_spin_yield, nb::arg("on"),
        "Kernel-pool helpers yield the core while they wait for a job (on) or pause on it (off).");
  m.def("pool_spin_yield", &mlxd::rt::pool_spin_yield);
  m.def("cpu_vector_kernels", &mlxd::rt::cpu_use_avx2,
        "Whether the CPU kernels run their vector (AVX2 + FMA) code: kernels on and the CPU has it.");
  m.def("set_stream_linger", &set_linger_us, nb::arg("us"),
        "Longest time (us) MLX's CPU stream thread stays awake after a call while calls come back to back "
        "(0: never; MLX_DELEGATE_LINGER_US sets it at start-up, default 200).");
  m.def("stream_linger", &linger_us);
  m.def("set_stream_gate", &set_stream_gate, nb::arg("mode"),
        "Small graphs sent to a sleeping MLX stream thread wake it once, for a gate task, instead of once per "
        "task: 0 off, 1 on (default), 2 on with the caller spinning for the result (MLX_DELEGATE_STREAM_GATE at start-up).");
  m.def("stream_gate", &stream_gate);
  m.def("set_caller_serve", &set_caller_serve, nb::arg("on"),
        "Whether a caller waiting for a long evaluation takes parts of the kernel pool's jobs meanwhile, in place "
        "of the pool's helper thread (on, the default; MLX_DELEGATE_CALLER_SERVE=0 at start-up turns it off).");
  m.def("caller_serve", &caller_serve);
  m.def("set_stream_park", &set_stream_park, nb::arg("on"),
        "Delegate calls run on a CPU stream of their own per thread, whose thread a small graph called with "
        "long gaps leaves parked (asleep on the delegate's own condition variable) so the next call wakes it "
        "once, after enqueueing (MLX_DELEGATE_STREAM_PARK=0 at start-up turns it off).");
  m.def("stream_park", &stream_park);
  m.def("set_buffer_cache_cap", &mlxd::rt::set_buffer_cache_cap, nb::arg("bytes"),
        "Largest MLX buffer-cache limit (bytes) the runtime raises it to after a call whose working set exceeded "
        "it (0: leave MLX's limit alone; MLX_DELEGATE_BUFFER_CACHE_MB at start-up, default a quarter of MLX's "
        "memory limit).");
  m.def("buffer_cache_cap", &mlxd::rt::buffer_cache_cap);
  m.def("stream_wait_stats", [] {
    auto s = stream_wait_stats();
    return std::map<std::string, uint64_t>{{"calls", s.calls}, {"held", s.held}, {"lingers", s.lingers},
                                           {"spins", s.spins}, {"spin_hits", s.spin_hits},
                                           {"linger_timeouts", s.linger_timeouts}, {"lingers_cut", s.lingers_cut},
                                           {"parks", s.parks},
                                           {"gates", s.gates}, {"stream_parks", s.stream_parks},
                                           {"unparked", s.unparked}, {"park_timeouts", s.park_timeouts},
                                           {"serves", s.serves}, {"serve_timeouts", s.serve_timeouts},
                                           {"served_parts", s.served_parts}};
  }, "Process-wide counters of the adaptive wait: evaluations, those that found the stream thread awake (held), "
     "lingers enqueued, caller spins (and those that saw the result), lingers that ended unused, calls that "
     "sent the kernels' helper threads to sleep at their end (parks), park tasks enqueued on a delegate stream "
     "(stream_parks), evaluations that released one after enqueueing (unparked), parks that timed out, "
     "evaluations whose caller served the kernel pool while it waited (serves), those it served until the time "
     "bound instead of the result (serve_timeouts) and the parts it ran "
     "(served_parts, not reset).");
  m.def("reset_stream_wait_stats", &reset_stream_wait_stats);
  m.def("set_huge_page_constants", &mlxd::rt::set_huge_page_constants, nb::arg("on"),
        "A method's constants are copied at load into one arena of memory advised for transparent huge pages, "
        "each a view of its slice, where they add up to 4 MiB or more (on, the default on Linux with the CPU as "
        "MLX's device; MLX_DELEGATE_HUGE_PAGES=0 starts with it off), or handed to MLX one by one (off); read "
        "when a program loads.");
  m.def("huge_page_constants", &mlxd::rt::huge_page_constants);
  m.def("set_constant_arena", &mlxd::rt::set_constant_arena, nb::arg("on"),
        "With huge-page constants on: all of a method's constants in one arena (on, the default; "
        "MLX_DELEGATE_CONSTANT_ARENA=0 starts with it off) or only those of 4 MiB and more, each in memory of its "
        "own (off, for A/B runs); read when a program loads.");
  m.def("constant_arena", &mlxd::rt::constant_arena);
  m.def("set_pool_hold_in_call", &mlxd::rt::set_pool_hold_in_call, nb::arg("on"),
        "A large graph's evaluation (more than 32 nodes) keeps the kernel pool's helpers awake between its jobs, "
        "yielding their core while they wait (on; opt-in, MLX_DELEGATE_POOL_HOLD=1 at start-up), or lets them "
        "sleep after their spin (MLX_DELEGATE_SPIN_US) as between calls (off, the default).");
  m.def("pool_hold_in_call", &mlxd::rt::pool_hold_in_call);
  m.def("set_pool_omp_team", [](const std::string& mode) {
    using mlxd::rt::OmpTeam;
    const OmpTeam m = mode == "off" ? OmpTeam::Off : mode == "auto" ? OmpTeam::Auto : mode == "always" ? OmpTeam::Always
                      : throw nb::value_error(("OpenMP team mode must be 'off', 'auto' or 'always', not '" + mode + "'").c_str());
    mlxd::rt::set_pool_omp_team(m);
  }, nb::arg("mode"),
        "Whether a call lends its calling thread's OpenMP team (torch's libgomp) to the kernel pool, whose parts the "
        "team's workers then take for the call's span: 'auto' (the default; MLX_DELEGATE_OMP_TEAM=off|auto|always at "
        "start-up) while calls follow each other closely and lent calls measure faster, 'always' (every call whose "
        "evaluations take 200 us or more; A/B runs), 'off' (the pool's own helpers).");
  m.def("pool_omp_team", [] {
    static const char* names[] = {"off", "auto", "always"};
    return std::string(names[int(mlxd::rt::pool_omp_team())]);
  });
  m.def("omp_team_stats", [] {
    const auto s = mlxd::rt::cpu_pool_omp_team_stats();
    return std::map<std::string, uint64_t>{{"calls", s.calls}, {"parts", s.parts}, {"pauses", s.pauses}};
  }, "Calls that lent their OpenMP team to the kernel pool so far (calls), the parts its workers ran (parts), and "
     "the calls that paused the team's idle threads first (pauses).");
  m.def("set_pool_omp_pause", &mlxd::rt::set_pool_omp_pause, nb::arg("on"),
        "Whether a long call that does not lend its OpenMP team (torch's libgomp) first ends the team's idle "
        "threads, which spin for milliseconds after each eager torch op against the kernel pool (on, the default; "
        "MLX_DELEGATE_OMP_PAUSE=0 at start-up turns it off).");
  m.def("pool_omp_pause", &mlxd::rt::pool_omp_pause);
  m.def("set_step_counters", &mlxd::rt::cpu_pool_set_stats, nb::arg("on"),
        "Per-step counters of the kernel pool's jobs and the quantized GEMV's calls (off by default: a few clock "
        "reads per product when on); read with step_counters().");
  m.def("step_counters", [] {
    const auto p = mlxd::rt::cpu_pool_stats();
    const auto q = mlxd::rt::qgemv_cpu_stats();
    return std::map<std::string, uint64_t>{
        {"pool_jobs", p.jobs}, {"pool_caller_parts", p.caller_parts}, {"pool_helper_parts", p.helper_parts},
        {"pool_caller_wait_ns", p.caller_wait_ns}, {"pool_helper_late_ns", p.helper_late_ns},
        {"pool_helper_missed", p.helper_missed}, {"pool_helper_sleeps", p.helper_sleeps},
        {"qgemv_calls", q.calls}, {"qgemv_wall_ns", q.wall_ns}, {"qgemv_cpu_ns", q.cpu_ns},
        {"qgemv_parallel_ns", q.parallel_ns}, {"qgemv_bytes", q.bytes}, {"qgemv_gaps", q.gaps},
        {"qgemv_gap_wall_ns", q.gap_wall_ns}, {"qgemv_gap_cpu_ns", q.gap_cpu_ns}, {"qgemv_lead_ns", q.lead_ns},
        {"qgemv_tail_ns", q.tail_ns}};
  }, "Sums since reset_step_counters(): the pool's jobs (parts run by the caller and by helpers, the caller's "
     "wait for helpers' parts, helpers' lateness and wake-ups from sleep, jobs no helper joined) and the quantized "
     "GEMV's calls (wall and thread CPU time, the parallel part, bytes of weights read, and the gaps between "
     "consecutive calls on one thread within a step).");
  m.def("reset_step_counters", [] {
    mlxd::rt::cpu_pool_reset_stats();
    mlxd::rt::qgemv_cpu_reset_stats();
  });
  m.def("step_counters_begin", &mlxd::rt::qgemv_cpu_step_begin,
        "Marks the start of a step: the gap before its first quantized product is not counted; the time to it "
        "is the step's lead-in.");
  m.def("step_counters_end", &mlxd::rt::qgemv_cpu_step_end,
        "Marks the end of a step (after its call returned): the time since its last quantized product is its tail.");
  if (!register_backend()) throw std::runtime_error("mlx_delegate: could not register the backend with ExecuTorch");
}
