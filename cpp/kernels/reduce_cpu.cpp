// Reductions over the trailing axes on the CPU (see reduce_cpu.h).
//
// x is read as [outer, length]: each row a contiguous span, reduced by sixteen lanes of float64 running
// sums (or float32 extremes), cut into chunks when there are too few rows to share among the pool's
// threads, the chunks' partials combined after. The loops are GCC vector code built for AVX-512, AVX2
// and the baseline (target_clones). Max / min keep a per-lane NaN flag: a max instruction alone drops a
// NaN operand.
#include "kernels/reduce_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MLXD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MLXD_CLONES
#endif

const char* const kNames[] = {"sum", "mean", "max", "min"};  // the kernel call counters, by ReduceKind

struct Extent {
  int64_t outer, length;
  bool operator==(const Extent& o) const { return outer == o.outer && length == o.length; }
};

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// GCC vectors: one zmm in the AVX-512 clone, two ymm in the AVX2 one, four xmm in the baseline.
typedef float F8 __attribute__((vector_size(32)));
typedef float F16 __attribute__((vector_size(64)));
typedef int I16 __attribute__((vector_size(64)));
typedef double D8 __attribute__((vector_size(64)));

inline F16 load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline D8 widen(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, D8);
}

// ---- Spans --------------------------------------------------------------------------

MLXD_CLONES double sum_span(const float* x, int64_t n) {
  D8 a = {}, b = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a += widen(x + i);
    b += widen(x + i + 8);
  }
  double total = 0.0;
  for (; i < n; ++i) total += x[i];
  for (int j = 0; j < 8; ++j) total += a[j] + b[j];
  return total;
}

// The span's largest (is_max) or smallest element; NaN where any element is.
MLXD_CLONES float extreme_span(const float* x, int64_t n, bool is_max) {
  F16 acc = F16{} + (is_max ? -kInf : kInf);
  I16 nan = {};
  int64_t i = 0;
  if (is_max) {
    for (; i + 16 <= n; i += 16) {
      const F16 v = load16(x + i);
      acc = v > acc ? v : acc;
      nan |= v != v;
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      const F16 v = load16(x + i);
      acc = v < acc ? v : acc;
      nan |= v != v;
    }
  }
  float r = is_max ? -kInf : kInf;
  bool any_nan = false;
  for (; i < n; ++i) {
    any_nan |= x[i] != x[i];
    r = is_max ? std::max(r, x[i]) : std::min(r, x[i]);
  }
  for (int j = 0; j < 16; ++j) {
    any_nan |= nan[j] != 0;
    r = is_max ? std::max(r, acc[j]) : std::min(r, acc[j]);
  }
  return any_nan ? kNaN : r;
}

// ---- One call -------------------------------------------------------------------------------

constexpr int64_t kChunk = 1 << 14;  // elements per chunk of a span cut for the pool
bool sums(ReduceKind k) { return k == ReduceKind::sum || k == ReduceKind::mean; }

// The reduction of x (row-major float32) into y (outer float32).
void reduce_spans(ReduceKind kind, const Extent& e, const float* x, float* y) {
  const int threads = cpu_pool_threads();
  const int64_t chunks =
      e.outer >= 2 * threads ? 1 : std::clamp<int64_t>(e.length / kChunk, 1, 4 * threads);
  std::vector<double> part(static_cast<size_t>(e.outer * chunks));
  cpu_parallel_for(e.outer * chunks, (e.length + chunks - 1) / chunks, 1, [&](int64_t b, int64_t end) {
    for (int64_t item = b; item < end; ++item) {
      const int64_t o = item / chunks, c = item % chunks;
      const int64_t l0 = e.length * c / chunks, l1 = e.length * (c + 1) / chunks;
      const float* span = x + o * e.length + l0;
      part[item] = sums(kind) ? sum_span(span, l1 - l0) : extreme_span(span, l1 - l0, kind == ReduceKind::max);
    }
  });
  for (int64_t o = 0; o < e.outer; ++o) {
    double r = part[o * chunks];
    for (int64_t c = 1; c < chunks; ++c) {
      const double v = part[o * chunks + c];
      if (sums(kind)) r += v;
      else if (std::isnan(v) || std::isnan(r)) r = kNaN;
      else r = kind == ReduceKind::max ? std::max(r, v) : std::min(r, v);
    }
    y[o] = static_cast<float>(kind == ReduceKind::mean ? r / static_cast<double>(e.length) : r);
  }
}

const ChainableKernel kReduceCpuChainable{"ReduceCpu"};  // kernel_chain.h

class ReduceCpu : public mx::UnaryPrimitive {
 public:
  ReduceCpu(mx::Stream s, ReduceKind kind, Extent e, mx::Shape shape)
      : mx::UnaryPrimitive(s), kind_(kind), e_(e), shape_(std::move(shape)) {}

  // in: x (any layout; packed and widened to row-major float32 inside the task when it is not that).
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    cpu_kernel_note_call(kNames[static_cast<int>(kind_)]);
    encoder.dispatch([x = in[0], y = out.data<void>(), dtype = out.dtype(), kind = kind_, e = e_] {
      const F32RowMajor xs(x);
      std::vector<float> staged(dtype == mx::float32 ? 0 : static_cast<size_t>(e.outer));
      float* yf = dtype == mx::float32 ? static_cast<float*>(y) : staged.data();
      reduce_spans(kind, e, xs.data(), yf);
      if (dtype != mx::float32) cpu_store_f32(yf, dtype, 0, e.outer, y);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ReduceCpu runs on the CPU only");
  }
  const char* name() const override { return "ReduceCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const ReduceCpu&>(other);
    return kind_ == o.kind_ && e_ == o.e_ && shape_ == o.shape_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override { return {shape_}; }

 private:
  ReduceKind kind_;
  Extent e_;
  mx::Shape shape_;
};

}  // namespace

bool reduce_cpu_applies(const mx::array& x, const std::vector<int>& axes) {
  if (!cpu_kernels_active() || !cpu_kernel_dtype_ok(x) || axes.empty() || axes.size() > x.ndim()) return false;
  std::vector<int> sorted = axes;
  std::sort(sorted.begin(), sorted.end());
  const int first = static_cast<int>(x.ndim() - sorted.size());  // the trailing axes, each once
  for (size_t i = 0; i < sorted.size(); ++i)
    if (sorted[i] != first + static_cast<int>(i)) return false;
  return true;
}

mx::array reduce_cpu(const mx::array& x, ReduceKind kind, const std::vector<int>& axes, bool keepdims) {
  if (!reduce_cpu_applies(x, axes)) throw std::invalid_argument("reduce_cpu: operands it does not take");
  const int first = static_cast<int>(x.ndim() - axes.size());
  Extent e{1, 1};
  mx::Shape shape;
  for (int i = 0; i < static_cast<int>(x.ndim()); ++i) {
    const bool reduced = i >= first;
    (reduced ? e.length : e.outer) *= x.shape(i);
    if (!reduced || keepdims) shape.push_back(reduced ? 1 : x.shape(i));
  }
  return mx::array(shape, x.dtype(), std::make_shared<ReduceCpu>(mx::default_stream(mx::Device::cpu), kind, e, shape),
                   {x});
}

}  // namespace mlxd::rt
