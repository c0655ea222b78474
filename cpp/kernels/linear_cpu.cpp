// See linear_cpu.h.
#include "kernels/linear_cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/gemm_lowp_cpu.h"
#include "kernels/unary_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

// Below this many multiply-adds a product runs on the calling thread (the
// BLAS front's threshold: waking the helper costs more than it saves).
constexpr double kSerialMacs = 1 << 20;

// A long product is cut into at least one part per this many multiply-adds (~1 ms of a core), up to 4
// per pool thread: parts are claimed as threads come free, so a thread that starts late (woken, or
// preempted by another process) leaves the others at most a part to wait for, where with one part per
// thread they waited for its whole share. ViT-B/16 at batch 8 (products of 0.9-3.7 G multiply-adds):
// 1.07x eager's time against 1.24x with one part per thread; BERT T 512 0.97x against 1.05x (2026-11-27,
// load ~1). MLX_DELEGATE_LINEAR_PART_MACS sets it (0: one part per thread, as before).
double part_macs() {
  static const double v = [] {
    const char* e = std::getenv("MLX_DELEGATE_LINEAR_PART_MACS");
    return e ? std::max(0.0, std::strtod(e, nullptr)) : 128.0 * (1 << 20);
  }();
  return v;
}

// The BLAS front's split shape (parts per pool thread, axis: 0 the longer
// output axis, 1 rows, 2 columns), so one setting (_blas.set_split_shape)
// cuts MLX's products and these alike; 1 part per thread along the longer
// axis without the front.
struct SplitShape {
  int parts_per_thread, axis;
};
SplitShape split_shape() {
  static const auto fn = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mlxd_blas_split_shape"));
  const int s = fn ? fn() : 4;
  return {std::max(1, s / 4), s % 4};
}

// The BLAS front's split mode (mlxd_blas_split_mode): 2 when products are cut evenly over the pool, as
// this kernel cuts them; under another policy (measured, balanced) or with splitting off (MKL's own
// OpenMP team) MLX's matmul takes the linears, so that those switches keep meaning what they say.
int blas_split_mode() {
  static const auto fn = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "mlxd_blas_split_mode"));
  return fn ? fn() : 2;
}

struct Linear {
  const float *x, *w, *bias;  // x [m, k] row-major, w [n, k] row-major, bias [n] or null
  float* y;                   // [m, n]
  int m, n, k;
  const float* residual = nullptr;  // [m, n] row-major or null
  UnaryMapFn act = nullptr;         // applied last, in place, while the block is in cache

  // Rows or columns [lo, hi) of y: the product, then the bias and the residual added while the block
  // is in cache (MLX's broadcast add after its matmul is a single-core pass over the whole output).
  // (The bias as the sgemm's C with beta = 1, as torch's addmm, measured no better: 573 / 797 us of
  // CPU per linear against 576 / 701 us adding it after, benchmarks/linears.py at load ~6.)
  void block(SerialSgemmFn sgemm, bool by_rows, int lo, int hi) const {
    const int r0 = by_rows ? lo : 0, r1 = by_rows ? hi : m, c0 = by_rows ? 0 : lo, c1 = by_rows ? n : hi;
    sgemm(0, 1, r1 - r0, c1 - c0, k, 1.f, x + int64_t{r0} * k, k, w + int64_t{c0} * k, k, 0.f,
          y + int64_t{r0} * n + c0, n);
    if (!bias && !residual && !act) return;
    for (int r = r0; r < r1; ++r) {
      float* row = y + int64_t{r} * n;
      const float* add = residual ? residual + int64_t{r} * n : nullptr;
      if (bias && add) {
        for (int c = c0; c < c1; ++c) row[c] += bias[c] + add[c];
      } else if (bias) {
        for (int c = c0; c < c1; ++c) row[c] += bias[c];
      } else if (add) {
        for (int c = c0; c < c1; ++c) row[c] += add[c];
      }
      if (act) act(row + c0, row + c0, c1 - c0);
    }
  }

  void run() const {
    const SerialSgemmFn sgemm = serial_sgemm();
    const auto shape = split_shape();
    const bool by_rows = shape.axis == 0 ? m > n : shape.axis == 1;
    const int extent = by_rows ? m : n;
    const double macs = static_cast<double>(m) * n * k;
    const int threads = cpu_pool_threads();
    int parts = macs < kSerialMacs ? 1 : threads * shape.parts_per_thread;
    if (parts > 1 && part_macs() > 0) {
      const int by_size = static_cast<int>(std::min<double>(std::ceil(macs / part_macs()), 4.0 * threads));
      parts = std::max(parts, (by_size + threads - 1) / threads * threads);  // whole rounds of the pool
    }
    parts = std::max(1, std::min(parts, extent / 32));
    // Block boundaries at multiples of 16 (whole vector widths) except the end.
    auto bound = [&](int i) {
      if (i >= parts) return extent;
      const int b = static_cast<int>(int64_t{extent} * i / parts);
      return b - b % 16;
    };
    cpu_parallel_parts(parts, [&](int i) {
      const int lo = bound(i), hi = bound(i + 1);
      if (lo < hi) block(sgemm, by_rows, lo, hi);
    });
  }
};

const ChainableKernel kLinearCpuChainable{"LinearCpu"};  // kernel_chain.h

class LinearCpu : public mx::UnaryPrimitive {
 public:
  LinearCpu(mx::Stream s, bool bias, bool residual, std::optional<UnaryKernel> act)
      : mx::UnaryPrimitive(s), bias_(bias), residual_(residual), act_(act) {}

  // in: x (any layout, float32), w [N, K] row-major, bias [N] row-major when present, then the
  // residual (the output's shape, any layout) when present.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto &x = in[0], &w = in[1];
    const int k = w.shape(1), n = w.shape(0);
    Linear p{x.data<float>(), w.data<float>(), bias_ ? in[2].data<float>() : nullptr, out.data<float>(),
             static_cast<int>(x.size() / k), n, k};
    if (act_) p.act = unary_cpu_map(*act_);
    cpu_kernel_note_call("linear_f32");
    const mx::array* r = residual_ ? &in.back() : nullptr;
    encoder.dispatch([p, shape = x.shape(), strides = x.strides(), contiguous = x.flags().row_contiguous,
                      r_data = r ? r->data<float>() : nullptr, r_shape = r ? r->shape() : mx::Shape{},
                      r_strides = r ? r->strides() : mx::Strides{},
                      r_contiguous = r && r->flags().row_contiguous]() mutable {
      CpuRowMajor xs(p.x, sizeof(float), shape, strides, contiguous);
      p.x = static_cast<const float*>(xs.data());
      std::optional<CpuRowMajor> rs;
      if (r_data) {
        rs.emplace(r_data, sizeof(float), r_shape, r_strides, r_contiguous);
        p.residual = static_cast<const float*>(rs->data());
      }
      p.run();
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("LinearCpu runs on the CPU only");
  }
  const char* name() const override { return "LinearCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const LinearCpu&>(other);
    return bias_ == o.bias_ && residual_ == o.residual_ && act_ == o.act_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }

 private:
  bool bias_, residual_;
  std::optional<UnaryKernel> act_;
};

// On by default (MLX_DELEGATE_LINEAR_KERNEL=0 turns it off): with the residual add fused too
// (patterns/linear_residual.py) the demo block and nn.TransformerEncoder ran 4-12 % faster than MLX's
// matmul + broadcast add, whose add is one core's pass over the whole output after the product
// (2026-11-26 17:25-17:40, docs/performance.md). Before the residual was fused, this kernel took 2-10 %
// more CPU per linear in chains of 128-row linears (benchmarks/linears.py, load 5-7).
std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("MLX_DELEGATE_LINEAR_KERNEL");
    return !(e && std::strcmp(e, "0") == 0);
  }()};
  return on;
}

}  // namespace

bool set_linear_cpu(bool on) { return enabled_flag().exchange(on, std::memory_order_relaxed); }
bool linear_cpu_enabled() { return enabled_flag().load(std::memory_order_relaxed); }

bool linear_cpu_applies(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                        const std::optional<mx::array>& residual) {
  if (!linear_cpu_enabled() || !cpu_kernels_active() || serial_sgemm() == nullptr || blas_split_mode() != 2)
    return false;
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 || x.ndim() < 1 || w.ndim() != 2) return false;
  if (x.shape(-1) != w.shape(1) || x.size() == 0 || w.size() == 0) return false;
  if (static_cast<int64_t>(x.size() / x.shape(-1)) <= kGemmLowpGemvRows) return false;
  // The weight is read in place: a loaded constant, row-major.
  if (!w.is_available() || !w.flags().row_contiguous) return false;
  if (residual) {
    auto shape = x.shape();
    shape.back() = w.shape(0);
    if (residual->dtype() != mx::float32 || residual->shape() != shape) return false;
  }
  return !bias || (bias->dtype() == mx::float32 && bias->ndim() == 1 && bias->shape(0) == w.shape(0));
}

mx::array linear_cpu(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                     const std::optional<mx::array>& residual, std::optional<UnaryKernel> act) {
  if (!linear_cpu_applies(x, w, bias, residual)) throw std::invalid_argument("linear_cpu: operands it does not take");
  std::vector<mx::array> inputs{x, w};
  // A constant bias is already row-major; anything else becomes so in the graph.
  if (bias) inputs.push_back(bias->is_available() && bias->flags().row_contiguous ? *bias : mx::contiguous(*bias));
  if (residual) inputs.push_back(*residual);  // any layout: packed in the task when it is not row-major
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<LinearCpu>(mx::default_stream(mx::Device::cpu), bias.has_value(),
                                               residual.has_value(), act),
                   std::move(inputs));
}

}  // namespace mlxd::rt
