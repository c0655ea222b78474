// Argmax / argmin over the last axis on the CPU (see rows_cpu.h): one pass for the row's extreme value
// and whether it holds a NaN, then one for the first index holding it (or the first NaN), both eight
// lanes at a time with AVX2; rows split across the cores. Half-type rows are widened first. MLX's own
// arg-reduce is a scalar loop over strided indices (~40 us for a 49152-entry logits row).
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/rows_cpu.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

int64_t first_index_portable(const float* x, int64_t n, bool max) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (max ? x[i] > x[best] : x[i] < x[best]) best = i;
  }
  return best;
}

#ifdef MLXD_CPU_X86
MLXD_AVX2 int64_t first_index_avx2(const float* x, int64_t n, bool max) {
  __m256 m = _mm256_set1_ps(x[0]), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = max ? _mm256_max_ps(m, v) : _mm256_min_ps(m, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float best = lanes[0];
  for (int l = 1; l < 8; ++l) best = max ? std::fmax(best, lanes[l]) : std::fmin(best, lanes[l]);
  for (int64_t j = i; j < n; ++j) {
    any_nan |= std::isnan(x[j]);
    best = max ? std::fmax(best, x[j]) : std::fmin(best, x[j]);
  }
  // The first lane holding the extreme (or a NaN): -0.0 and 0.0 compare equal, as in torch.
  const __m256 t = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i)
    if (any_nan ? std::isnan(x[i]) : x[i] == best) return i;
  return 0;
}
#endif

int64_t first_index(const float* x, int64_t n, bool max) {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2()) return first_index_avx2(x, n, max);
#endif
  return first_index_portable(x, n, max);
}

const ChainableKernel kArgRowsCpuChainable{"ArgRowsCpu"};  // kernel_chain.h

class ArgRowsCpu : public mx::UnaryPrimitive {
 public:
  ArgRowsCpu(mx::Stream s, bool max, int64_t n, mx::Shape shape)
      : mx::UnaryPrimitive(s), max_(max), n_(n), shape_(std::move(shape)) {}

  // in: x (or the array x is a reshape of), any layout, read in row-major order as rows of n_.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto& x = in[0];
    cpu_kernel_note_call(max_ ? "argmax" : "argmin");
    encoder.dispatch([max = max_, n = n_, p = x.data<void>(), type = x.dtype(), shape = x.shape(),
                      strides = x.strides(), contiguous = x.flags().row_contiguous, itemsize = x.itemsize(),
                      rows = static_cast<int64_t>(x.size()) / n_, y = out.data<int64_t>()] {
      CpuRowMajor xs(p, itemsize, shape, strides, contiguous);
      cpu_parallel_for(rows, n, 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> widened;
        for (int64_t r = begin; r < end; ++r) {
          const float* row = static_cast<const float*>(xs.data()) + r * n;
          if (type != mx::float32) {
            float* buf = at_least(widened, n);
            cpu_load_f32(xs.data(), type, r * n, n, buf);
            row = buf;
          }
          y[r] = first_index(row, n, max);
        }
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ArgRowsCpu runs on the CPU only");
  }
  const char* name() const override { return "ArgRowsCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const ArgRowsCpu&>(other);
    return max_ == o.max_ && n_ == o.n_ && shape_ == o.shape_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override { return {shape_}; }

 private:
  bool max_;
  int64_t n_;
  mx::Shape shape_;
};

bool is_reshape(const mx::array& x) {
  if (!x.has_primitive() || x.inputs().size() != 1) return false;
  const char* name = x.primitive().name();
  return std::strcmp(name, "Reshape") == 0 || std::strcmp(name, "Squeeze") == 0 ||
         std::strcmp(name, "ExpandDims") == 0;
}

}  // namespace

bool arg_rows_cpu_applies(const mx::array& x) {
  return cpu_kernels_active() && cpu_kernel_dtype_ok(x) && x.ndim() >= 1;
}

mx::array arg_rows_cpu(const mx::array& x, bool max, bool keepdims) {
  auto shape = x.shape();
  if (keepdims) {
    shape.back() = 1;
  } else {
    shape.pop_back();
  }
  auto prim = std::make_shared<ArgRowsCpu>(mx::default_stream(mx::Device::cpu), max, x.shape(-1), shape);
  return mx::array(std::move(shape), mx::int64, std::move(prim), {is_reshape(x) ? x.inputs()[0] : x});
}

}  // namespace mlxd::rt
