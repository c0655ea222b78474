// Row kernels on the CPU: each row is reduced (max / sum / sum of squares)
// and then mapped, both passes vectorised; rows are split across the cores.
// Half-type rows are widened into a per-thread float32 buffer first.
#include "kernels/rows_cpu.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

// One row: x holds n floats, y n floats (may be x) or one for reductions; w
// and b are n floats or null.
struct Row {
  const float* x;
  float* y;
  int64_t n;
  const float* w;
  const float* b;
  float eps;
};
using RowFn = void (*)(const Row&);

// Writes y = (x - shift) * scale, then applies the optional weight and bias.
void affine_portable(const Row& r, float shift, float scale) {
  for (int64_t i = 0; i < r.n; ++i) {
    float v = (r.x[i] - shift) * scale;
    if (r.w) v *= r.w[i];
    if (r.b) v += r.b[i];
    r.y[i] = v;
  }
}

void rms_norm_portable(const Row& r) {
  float ss = 0.f;
  for (int64_t i = 0; i < r.n; ++i) ss += r.x[i] * r.x[i];
  affine_portable(r, 0.f, 1.f / std::sqrt(ss / r.n + r.eps));
}

void layer_norm_portable(const Row& r) {
  float sum = 0.f, sq = 0.f;
  for (int64_t i = 0; i < r.n; ++i) sum += r.x[i];
  const float mean = sum / r.n;
  for (int64_t i = 0; i < r.n; ++i) sq += (r.x[i] - mean) * (r.x[i] - mean);
  affine_portable(r, mean, 1.f / std::sqrt(sq / r.n + r.eps));
}

float row_max_portable(const Row& r) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < r.n; ++i) m = std::max(m, r.x[i]);
  return m;
}

void softmax_portable(const Row& r) {
  const float m = row_max_portable(r);
  float sum = 0.f;
  for (int64_t i = 0; i < r.n; ++i) sum += (r.y[i] = std::exp(r.x[i] - m));
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < r.n; ++i) r.y[i] *= inv;
}

void log_softmax_portable(const Row& r) {
  const float m = row_max_portable(r);
  float sum = 0.f;
  for (int64_t i = 0; i < r.n; ++i) sum += std::exp(r.x[i] - m);
  const float shift = m + std::log(sum);
  for (int64_t i = 0; i < r.n; ++i) r.y[i] = r.x[i] - shift;
}

#ifdef MLXD_CPU_X86
using vmath::set1;

// The row in vectors of eight: f(vector, lanes) for each full vector and the
// tail (lanes < 8, padded with `fill`).
template <class F>
MLXD_AVX2 inline void for_vectors(const float* x, int64_t n, float fill, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) f(i, _mm256_loadu_ps(x + i), 8);
  if (i < n) f(i, vmath::load_partial(x + i, static_cast<int>(n - i), fill), static_cast<int>(n - i));
}

MLXD_AVX2 inline __m256 load(const float* p, int lanes) {
  return lanes == 8 ? _mm256_loadu_ps(p) : vmath::load_partial(p, lanes, 0.f);
}

MLXD_AVX2 inline void store(float* p, __m256 v, int lanes) {
  if (lanes == 8) {
    _mm256_storeu_ps(p, v);
  } else {
    vmath::store_partial(p, v, lanes);
  }
}

MLXD_AVX2 void affine_avx2(const Row& r, float shift, float scale) {
  const __m256 s = set1(scale), sh = set1(shift);
  for_vectors(r.x, r.n, 0.f, [&](int64_t i, __m256 v, int lanes) MLXD_AVX2 {
    v = _mm256_mul_ps(_mm256_sub_ps(v, sh), s);
    if (r.w) v = _mm256_mul_ps(v, load(r.w + i, lanes));
    if (r.b) v = _mm256_add_ps(v, load(r.b + i, lanes));
    store(r.y + i, v, lanes);
  });
}

MLXD_AVX2 void rms_norm_avx2(const Row& r) {
  __m256 acc = _mm256_setzero_ps();
  for_vectors(r.x, r.n, 0.f, [&](int64_t, __m256 v, int) MLXD_AVX2 { acc = _mm256_fmadd_ps(v, v, acc); });
  affine_avx2(r, 0.f, 1.f / std::sqrt(vmath::hsum8(acc) / r.n + r.eps));
}

MLXD_AVX2 void layer_norm_avx2(const Row& r) {
  __m256 acc = _mm256_setzero_ps();
  for_vectors(r.x, r.n, 0.f, [&](int64_t, __m256 v, int) MLXD_AVX2 { acc = _mm256_add_ps(v, acc); });
  const float mean = vmath::hsum8(acc) / r.n;
  const __m256 mv = set1(mean);
  acc = _mm256_setzero_ps();
  for_vectors(r.x, r.n, mean, [&](int64_t, __m256 v, int) MLXD_AVX2 {
    v = _mm256_sub_ps(v, mv);
    acc = _mm256_fmadd_ps(v, v, acc);
  });
  affine_avx2(r, mean, 1.f / std::sqrt(vmath::hsum8(acc) / r.n + r.eps));
}

MLXD_AVX2 float row_max_avx2(const Row& r) {
  __m256 m = set1(-std::numeric_limits<float>::infinity());
  for_vectors(r.x, r.n, -std::numeric_limits<float>::infinity(),
              [&](int64_t, __m256 v, int) MLXD_AVX2 { m = _mm256_max_ps(m, v); });
  return vmath::hmax8(m);
}

MLXD_AVX2 void softmax_avx2(const Row& r) {
  const __m256 m = set1(row_max_avx2(r));
  __m256 acc = _mm256_setzero_ps();
  for_vectors(r.x, r.n, -std::numeric_limits<float>::infinity(), [&](int64_t i, __m256 v, int lanes) MLXD_AVX2 {
    __m256 e = vmath::exp8(_mm256_sub_ps(v, m));
    acc = _mm256_add_ps(acc, e);
    store(r.y + i, e, lanes);
  });
  const __m256 inv = set1(1.f / vmath::hsum8(acc));
  for_vectors(r.y, r.n, 0.f, [&](int64_t i, __m256 v, int lanes) MLXD_AVX2 { store(r.y + i, _mm256_mul_ps(v, inv), lanes); });
}

MLXD_AVX2 void log_softmax_avx2(const Row& r) {
  const float mx_ = row_max_avx2(r);
  const __m256 m = set1(mx_);
  __m256 acc = _mm256_setzero_ps();
  for_vectors(r.x, r.n, -std::numeric_limits<float>::infinity(),
              [&](int64_t, __m256 v, int) MLXD_AVX2 { acc = _mm256_add_ps(acc, vmath::exp8(_mm256_sub_ps(v, m))); });
  const __m256 shift = set1(mx_ + std::log(vmath::hsum8(acc)));
  for_vectors(r.x, r.n, 0.f, [&](int64_t i, __m256 v, int lanes) MLXD_AVX2 { store(r.y + i, _mm256_sub_ps(v, shift), lanes); });
}
#endif

struct KernelInfo {
  const char* name;
  RowFn portable;
  RowFn avx2;
};

// Rows follow `enum class RowKernel`.
#ifdef MLXD_CPU_X86
#define MLXD_ROW(name, fn) {#name, fn##_portable, fn##_avx2}
#else
#define MLXD_ROW(name, fn) {#name, fn##_portable, nullptr}
#endif
const KernelInfo kKernels[] = {
    MLXD_ROW(rms_norm, rms_norm),
    MLXD_ROW(layer_norm, layer_norm),
    MLXD_ROW(softmax, softmax),
    MLXD_ROW(log_softmax, log_softmax),
};
#undef MLXD_ROW

const KernelInfo& info(RowKernel k) { return kKernels[static_cast<int>(k)]; }
RowFn pick(RowKernel k) { return cpu_use_avx2() && info(k).avx2 ? info(k).avx2 : info(k).portable; }

// What one call reads and writes: x [rows, n] in `in_type`, y [rows, n] in `out_type`.
struct Problem {
  RowFn fn;
  const void* x;
  void* y;
  mx::Dtype in_type, out_type;
  int64_t rows, n;
  const float* w;
  const float* b;
  float eps;
};

void run_rows(const Problem& p) {
  const bool direct = p.in_type == mx::float32 && p.out_type == mx::float32;
  cpu_parallel_for(p.rows, p.n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(direct ? 0 : p.n);
    for (int64_t r = begin; r < end; ++r) {
      if (direct) {
        p.fn({static_cast<const float*>(p.x) + r * p.n, static_cast<float*>(p.y) + r * p.n, p.n, p.w, p.b, p.eps});
        continue;
      }
      cpu_load_f32(p.x, p.in_type, r * p.n, p.n, buf.data());
      p.fn({buf.data(), buf.data(), p.n, p.w, p.b, p.eps});
      cpu_store_f32(buf.data(), p.out_type, r * p.n, p.n, p.y);
    }
  });
}

const ChainableKernel kRowsCpuChainable{"RowsCpu"};  // kernel_chain.h

class RowsCpu : public mx::UnaryPrimitive {
 public:
  RowsCpu(mx::Stream s, RowKernel kind, float eps, bool weight, bool bias)
      : mx::UnaryPrimitive(s), kind_(kind), eps_(eps), weight_(weight), bias_(bias) {}

  // in: x (any layout), then the weight and the bias when present (float32,
  // n row-contiguous elements).
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto& x = in[0];
    const int64_t n = x.shape(-1);
    size_t next = 1;
    const float* w = weight_ ? in[next++].data<float>() : nullptr;
    const float* b = bias_ ? in[next++].data<float>() : nullptr;
    Problem p{pick(kind_), x.data<void>(), out.data<void>(), x.dtype(), out.dtype(),
              static_cast<int64_t>(x.size()) / n, n, w, b, eps_};
    cpu_kernel_note_call(info(kind_).name);
    encoder.dispatch([p, shape = x.shape(), strides = x.strides(), contiguous = x.flags().row_contiguous,
                      itemsize = x.itemsize()]() mutable {
      CpuRowMajor xs(p.x, itemsize, shape, strides, contiguous);
      p.x = xs.data();
      run_rows(p);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RowsCpu runs on the CPU only");
  }
  const char* name() const override { return "RowsCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowsCpu&>(other);
    return kind_ == o.kind_ && eps_ == o.eps_ && weight_ == o.weight_ && bias_ == o.bias_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  RowKernel kind_;
  float eps_;
  bool weight_, bias_;
};

// A norm's weight or bias as row-contiguous float32: as is when it is such a
// constant already (no graph node per call), else converted.
mx::array float32_row_major(const mx::array& p) {
  if (p.dtype() == mx::float32 && p.ndim() == 1 && p.is_available() && p.flags().row_contiguous) return p;
  return mx::contiguous(mx::astype(mx::flatten(p), mx::float32));
}

bool param_ok(const std::optional<mx::array>& p, int64_t n) {
  return !p || (mx::issubdtype(p->dtype(), mx::floating) && static_cast<int64_t>(p->size()) == n);
}

}  // namespace

bool rows_cpu_applies(const mx::array& x, const std::optional<mx::array>& weight,
                      const std::optional<mx::array>& bias) {
  if (!cpu_kernels_active() || !cpu_kernel_dtype_ok(x) || x.ndim() < 1) return false;
  auto out_type = x.dtype();
  for (const auto* p : {&weight, &bias})
    if (*p) out_type = mx::promote_types(out_type, (*p)->dtype());
  if (out_type != mx::float32 && out_type != mx::bfloat16 && out_type != mx::float16) return false;
  return param_ok(weight, x.shape(-1)) && param_ok(bias, x.shape(-1));
}

mx::array rows_cpu(const mx::array& x, RowKernel kind, float eps, const std::optional<mx::array>& weight,
                   const std::optional<mx::array>& bias) {
  std::vector<mx::array> inputs{x};
  auto out_type = x.dtype();
  for (const auto* p : {&weight, &bias}) {
    if (!*p) continue;
    out_type = mx::promote_types(out_type, (*p)->dtype());
    inputs.push_back(float32_row_major(**p));
  }
  auto prim = std::make_shared<RowsCpu>(mx::default_stream(mx::Device::cpu), kind, eps, weight.has_value(),
                                        bias.has_value());
  return mx::array(x.shape(), out_type, std::move(prim), std::move(inputs));
}

}  // namespace mlxd::rt
