// Max pooling on the CPU (see pool_cpu.h): per output plane, AVX2 rows for
// width strides 1 and 2, a scalar loop otherwise and at the padded edges.
#include "kernels/pool_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

// A 1-D pool is a 2-D one over height-1 planes.
struct Window {
  int H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw;
};

struct PoolCall {
  const void* x;
  mx::Dtype dtype;
  mx::Shape shape;
  mx::Strides strides;
  bool contiguous;
  void* y;
  int64_t planes;
  Window w;
};

// The maximum of output (oh, ow)'s window; NaN propagates, as in torch: once
// m is NaN, nothing replaces it.
inline float window_max(const Window& w, const float* x, int oh, int ow) {
  const int h0 = oh * w.sh - w.ph, w0 = ow * w.sw - w.pw;
  float m = -std::numeric_limits<float>::infinity();
  for (int ki = 0; ki < w.kh; ++ki) {
    const int ih = h0 + ki * w.dh;
    if (ih < 0 || ih >= w.H) continue;
    const float* row = x + int64_t{ih} * w.W;
    for (int kj = 0; kj < w.kw; ++kj) {
      const int iw = w0 + kj * w.dw;
      if (iw >= 0 && iw < w.W && (row[iw] > m || std::isnan(row[iw]))) m = row[iw];
    }
  }
  return m;
}

void pool_plane(const Window& w, const float* x, float* y) {
  for (int oh = 0; oh < w.OH; ++oh)
    for (int ow = 0; ow < w.OW; ++ow) y[int64_t{oh} * w.OW + ow] = window_max(w, x, oh, ow);
}

#ifdef MLXD_CPU_X86
// One plane at width stride S: eight output columns at a time over the columns
// whose windows lie inside the row (loads included: S = 2 reads one past);
// the edges take window_max. NaNs are tracked apart (max_ps drops them).
template <int S>
MLXD_AVX2 void pool_plane_avx2(const Window& w, const float* x, float* y) {
  const int span = (w.kw - 1) * w.dw + (S - 1);
  int c1 = w.W - 1 + w.pw - span >= 0 ? (w.W - 1 + w.pw - span) / S + 1 : 0;
  c1 = std::min(c1, w.OW);
  const int c0 = std::min((w.pw + S - 1) / S, c1);
  for (int oh = 0; oh < w.OH; ++oh) {
    float* yrow = y + int64_t{oh} * w.OW;
    const float* rows[64];
    int nrows = 0;
    for (int ki = 0; ki < w.kh && nrows < 64; ++ki) {
      const int ih = oh * w.sh - w.ph + ki * w.dh;
      if (ih >= 0 && ih < w.H) rows[nrows++] = x + int64_t{ih} * w.W - w.pw;
    }
    if (nrows == 64 || nrows == 0) {  // very tall windows, or none inside: the scalar loop
      for (int ow = 0; ow < w.OW; ++ow) yrow[ow] = window_max(w, x, oh, ow);
      continue;
    }
    for (int ow = 0; ow < c0; ++ow) yrow[ow] = window_max(w, x, oh, ow);
    int ow = c0;
    for (; ow + 8 <= c1; ow += 8) {
      __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
      for (int r = 0; r < nrows; ++r)
        for (int kj = 0; kj < w.kw; ++kj) {
          const __m256 v = vmath::load_strided<S>(rows[r] + int64_t{ow} * S + kj * w.dw);
          m = _mm256_max_ps(m, v);
          nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
      _mm256_storeu_ps(yrow + ow, _mm256_blendv_ps(m, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan));
    }
    for (; ow < w.OW; ++ow) yrow[ow] = window_max(w, x, oh, ow);
  }
}
#endif

void run_max_pool(const PoolCall& c) {
  const Window& w = c.w;
  CpuRowMajor packed(c.x, mx::size_of(c.dtype), c.shape, c.strides, c.contiguous);
  const int64_t in_plane = int64_t{w.H} * w.W, out_plane = int64_t{w.OH} * w.OW;
  auto plane_fn = pool_plane;
#ifdef MLXD_CPU_X86
  if (cpu_use_avx2() && w.sw == 1) plane_fn = pool_plane_avx2<1>;
  if (cpu_use_avx2() && w.sw == 2) plane_fn = pool_plane_avx2<2>;
#endif
  cpu_parallel_for(c.planes, out_plane * w.kh * w.kw, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> src(c.dtype == mx::float32 ? 0 : in_plane), dst(out_plane);
    for (int64_t p = begin; p < end; ++p) {
      const float* x = static_cast<const float*>(packed.data()) + p * in_plane;
      if (c.dtype != mx::float32) {
        cpu_load_f32(packed.data(), c.dtype, p * in_plane, in_plane, src.data());
        x = src.data();
      }
      float* y = c.dtype == mx::float32 ? static_cast<float*>(c.y) + p * out_plane : dst.data();
      plane_fn(w, x, y);
      if (c.dtype != mx::float32) cpu_store_f32(dst.data(), c.dtype, p * out_plane, out_plane, c.y);
    }
  });
}

const ChainableKernel kMaxPoolCpuChainable{"MaxPoolCpu"};  // kernel_chain.h

class MaxPoolCpu : public mx::UnaryPrimitive {
 public:
  MaxPoolCpu(mx::Stream s, Window w, bool two_d) : mx::UnaryPrimitive(s), w_(w), two_d_(two_d) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto& x = in[0];
    PoolCall c{x.data<void>(), x.dtype(), x.shape(), x.strides(), x.flags().row_contiguous, out.data<void>(),
               static_cast<int64_t>(x.size() / (int64_t{w_.H} * w_.W)), w_};
    cpu_kernel_note_call("max_pool");
    encoder.dispatch([c = std::move(c)] { run_max_pool(c); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("MaxPoolCpu runs on the CPU only");
  }
  const char* name() const override { return "MaxPoolCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MaxPoolCpu&>(other);
    return std::memcmp(&w_, &o.w_, sizeof(Window)) == 0 && two_d_ == o.two_d_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto s = in[0].shape();
    s.back() = w_.OW;
    if (two_d_) s[s.size() - 2] = w_.OH;
    return {s};
  }

 private:
  Window w_;
  bool two_d_;
};

}  // namespace

bool max_pool_cpu_applies(const mx::array& x, size_t pooled_axes) {
  return cpu_kernels_active() && cpu_kernel_dtype_ok(x) && (pooled_axes == 1 || pooled_axes == 2) &&
         x.ndim() > pooled_axes;
}

mx::array max_pool_cpu(const mx::array& x, const std::vector<int>& kernel, const std::vector<int>& stride,
                       const std::vector<int>& padding, const std::vector<int>& dilation,
                       const std::vector<int>& out_sizes) {
  const size_t nd = kernel.size();
  if (!max_pool_cpu_applies(x, nd) || stride.size() != nd || padding.size() != nd || dilation.size() != nd ||
      out_sizes.size() != nd)
    throw std::invalid_argument("max_pool_cpu: operands it does not take");
  for (size_t i = 0; i < nd; ++i)
    if (kernel[i] < 1 || stride[i] < 1 || dilation[i] < 1 || padding[i] < 0 || out_sizes[i] < 1)
      throw std::invalid_argument("max pool: kernel, stride, dilation and outputs must be positive");
  const bool two = nd == 2;
  auto pick = [&](const std::vector<int>& v, int axis, int fill) { return two ? v[axis] : (axis ? v[0] : fill); };
  Window w{two ? x.shape(-2) : 1, x.shape(-1), pick(out_sizes, 0, 1), pick(out_sizes, 1, 1), pick(kernel, 0, 1),
           pick(kernel, 1, 1), pick(stride, 0, 1), pick(stride, 1, 1), pick(padding, 0, 0), pick(padding, 1, 0),
           pick(dilation, 0, 1), pick(dilation, 1, 1)};
  auto shape = x.shape();
  shape.back() = w.OW;
  if (two) shape[shape.size() - 2] = w.OH;
  auto prim = std::make_shared<MaxPoolCpu>(mx::default_stream(mx::Device::cpu), w, two);
  return mx::array(shape, x.dtype(), std::move(prim), {x});
}

}  // namespace mlxd::rt
