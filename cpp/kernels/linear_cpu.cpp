// See linear_cpu.h.
#include "kernels/linear_cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/gemm_lowp_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

// Below this many multiply-adds a product runs on the calling thread (the
// BLAS front's threshold: waking the helper costs more than it saves).
constexpr double kSerialMacs = 1 << 20;

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

struct Linear {
  const float *x, *w, *bias;  // x [m, k] row-major, w [n, k] row-major, bias [n] or null
  float* y;                   // [m, n]
  int m, n, k;

  // Rows or columns [lo, hi) of y: the product, then the bias added while the block is in cache.
  // (The bias as the sgemm's C with beta = 1, as torch's addmm, measured no better: 573 / 797 us of
  // CPU per linear against 576 / 701 us adding it after, benchmarks/linears.py at load ~6.)
  void block(SerialSgemmFn sgemm, bool by_rows, int lo, int hi) const {
    const int r0 = by_rows ? lo : 0, r1 = by_rows ? hi : m, c0 = by_rows ? 0 : lo, c1 = by_rows ? n : hi;
    sgemm(0, 1, r1 - r0, c1 - c0, k, 1.f, x + int64_t{r0} * k, k, w + int64_t{c0} * k, k, 0.f,
          y + int64_t{r0} * n + c0, n);
    if (!bias) return;
    for (int r = r0; r < r1; ++r) {
      float* row = y + int64_t{r} * n;
      for (int c = c0; c < c1; ++c) row[c] += bias[c];
    }
  }

  void run() const {
    const SerialSgemmFn sgemm = serial_sgemm();
    const auto shape = split_shape();
    const bool by_rows = shape.axis == 0 ? m > n : shape.axis == 1;
    const int extent = by_rows ? m : n;
    int parts = static_cast<double>(m) * n * k < kSerialMacs ? 1 : cpu_pool_threads() * shape.parts_per_thread;
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

class LinearCpu : public mx::UnaryPrimitive {
 public:
  LinearCpu(mx::Stream s, bool bias) : mx::UnaryPrimitive(s), bias_(bias) {}

  // in: x (any layout, float32), w [N, K] row-major, bias [N] row-major when present.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto &x = in[0], &w = in[1];
    const int k = w.shape(1), n = w.shape(0);
    Linear p{x.data<float>(), w.data<float>(), bias_ ? in[2].data<float>() : nullptr, out.data<float>(),
             static_cast<int>(x.size() / k), n, k};
    cpu_kernel_note_call("linear_f32");
    encoder.dispatch([p, shape = x.shape(), strides = x.strides(), contiguous = x.flags().row_contiguous]() mutable {
      CpuRowMajor xs(p.x, sizeof(float), shape, strides, contiguous);
      p.x = static_cast<const float*>(xs.data());
      p.run();
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("LinearCpu runs on the CPU only");
  }
  const char* name() const override { return "LinearCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return bias_ == static_cast<const LinearCpu&>(other).bias_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }

 private:
  bool bias_;
};

// Off by default: in the compiled run MLX's bias add after its matmul costs little (it is fused
// with what follows), and this kernel took 2-10 % more CPU per linear than matmul + add in chains of
// 128-row linears (benchmarks/linears.py, 2026-11-26, load 5-7); the demo block A/B was within noise.
std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("MLX_DELEGATE_LINEAR_KERNEL");
    return e && std::strcmp(e, "1") == 0;
  }()};
  return on;
}

}  // namespace

bool set_linear_cpu(bool on) { return enabled_flag().exchange(on, std::memory_order_relaxed); }
bool linear_cpu_enabled() { return enabled_flag().load(std::memory_order_relaxed); }

bool linear_cpu_applies(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  if (!linear_cpu_enabled() || !cpu_kernels_active() || serial_sgemm() == nullptr) return false;
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 || x.ndim() < 1 || w.ndim() != 2) return false;
  if (x.shape(-1) != w.shape(1) || x.size() == 0 || w.size() == 0) return false;
  if (static_cast<int64_t>(x.size() / x.shape(-1)) <= kGemmLowpGemvRows) return false;
  // The weight is read in place: a loaded constant, row-major.
  if (!w.is_available() || !w.flags().row_contiguous) return false;
  return !bias || (bias->dtype() == mx::float32 && bias->ndim() == 1 && bias->shape(0) == w.shape(0));
}

mx::array linear_cpu(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  if (!linear_cpu_applies(x, w, bias)) throw std::invalid_argument("linear_cpu: operands it does not take");
  std::vector<mx::array> inputs{x, w};
  // A constant bias is already row-major; anything else becomes so in the graph.
  if (bias) inputs.push_back(bias->is_available() && bias->flags().row_contiguous ? *bias : mx::contiguous(*bias));
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<LinearCpu>(mx::default_stream(mx::Device::cpu), bias.has_value()), std::move(inputs));
}

}  // namespace mlxd::rt
